"""Where redrafter-mlx keeps converted models: ``$REDRAFTER_HOME`` or ~/.cache/redrafter-mlx."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("REDRAFTER_HOME", Path.home() / ".cache" / "redrafter-mlx"))


def models_dir() -> Path:
    return cache_dir() / "models"
