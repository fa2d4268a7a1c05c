"""Llama family (mlx-lm ``llama``; Mistral and others remap to it)."""

from __future__ import annotations

import mlx.nn as nn

from .base import FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    model_types = ("llama", "mistral")

    def layer_windows(self, model: nn.Module) -> list[int | None]:
        # Layers marked "sliding_attention" in layer_types use model.model.sliding_window.
        window = model.model.sliding_window
        return [window if layer.use_sliding else None for layer in model.layers]
