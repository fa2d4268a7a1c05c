"""Per-family adapters between mlx-lm models and the ReDrafter engine."""

from __future__ import annotations

import mlx.nn as nn

from .base import FamilyAdapter
from .gemma3_text import Gemma3TextAdapter
from .llama import LlamaAdapter
from .qwen2 import Qwen2Adapter

ADAPTERS: dict[str, FamilyAdapter] = {
    t: adapter
    for adapter in (LlamaAdapter(), Qwen2Adapter(), Gemma3TextAdapter())
    for t in adapter.model_types
}


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter for an mlx-lm model, or a clear error naming the supported families."""
    model_type = getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(
            f"model type {model_type!r} is not supported by redrafter-mlx yet; "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return adapter


__all__ = ["ADAPTERS", "FamilyAdapter", "adapter_for"]
