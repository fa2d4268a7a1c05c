"""Per-machine measurements kept between runs: tuned beam shapes and autoregressive rates.

``bench`` records the AR tokens/s it measured and ``tune`` the fastest (W, L) for a model on
this machine; ``chat`` and ``generate`` read them back. Stored in
``$REDRAFTER_HOME/settings.json``, keyed by the model folder.
"""

from __future__ import annotations

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
