"""Per-machine measurements kept between runs: tuned beam shapes and autoregressive rates.

``bench`` records the AR tokens/s it measured and ``tune`` the fastest (W, L) for a model on
this machine; ``chat`` and ``generate`` read them back. Stored in
``$REDRAFTER_HOME/settings.json``, keyed by the model folder. A tuned shape holds for the
drafter weights and the BLAS it was measured with (:func:`tuned_for`): its step cost and
calibration mean nothing for others.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from . import paths


def _file() -> Path:
    return paths.cache_dir() / "settings.json"


def _load() -> dict[str, Any]:
    try:
        return json.loads(_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def get(model_dir: str | Path, key: str) -> Any:
    return _load().get(str(Path(model_dir).resolve()), {}).get(key)


def put(model_dir: str | Path, key: str, value: Any) -> None:
    data = _load()
    data.setdefault(str(Path(model_dir).resolve()), {})[key] = value
    path = _file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def tuned_for(drafter_dir: str | Path) -> dict[str, str]:
    """What a stored tune was measured with: the drafter (folder and weights), the BLAS (with
    the few-row GEMM kernel on or off) and the CPU (a settings file can outlive the machine
    under it: a virtual machine's home folder moved to another host, say)."""
    from . import _blas
    from .benchmark import chip

    folder = Path(drafter_dir).resolve()
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return {
        "drafter": str(folder),
        "drafter_sha256": digest.hexdigest()[:16],
        "blas": _blas.summary(),  # the few-row kernel too: it changes the step cost
        "chip": chip(),
    }


def tuned_beam(model_dir: str | Path, drafter_dir: str | Path | None) -> tuple[dict, str | None]:
    """`tune`'s stored shape for this model if it was measured with this drafter, BLAS and CPU.

    Returns (beam, None), or ({}, why) when a stored tune does not apply here: its width,
    length and step cost were the fastest for another drafter, BLAS or CPU.
    """
    beam = get(model_dir, "beam") or {}
    if not beam or drafter_dir is None:
        return {}, None
    if beam.get("drafter") != str(Path(drafter_dir).resolve()):
        return {}, "the shape `redrafter tune` stored was measured with another drafter"
    now = tuned_for(drafter_dir)  # reads the weights: only for the tuned drafter's folder
    stale = [k for k, v in now.items() if beam.get(k) != v]
    if stale and any(k not in beam for k in now):
        return {}, "the shape `redrafter tune` stored was measured by an earlier version"
    if stale:
        what = {
            "drafter_sha256": "other drafter weights",
            "chip": f"another CPU, {beam.get('chip')!r} (now {now['chip']!r})",
        }
        why = what.get(stale[0], f"BLAS {beam.get('blas')!r} (now {now['blas']!r})")
        return {}, f"the shape `redrafter tune` stored was measured with {why}"
    return beam, None
