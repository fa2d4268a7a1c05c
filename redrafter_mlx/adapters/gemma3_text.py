"""Gemma 3 text models (mlx-lm ``gemma3_text``): 5 of every 6 layers use a sliding window.

mlx-lm gives those layers a RotatingKVCache, which cannot take a tree and trim it back once
the window has filled; the engine uses a window TreeKVCache with exact masks instead.
"""

from __future__ import annotations

import mlx.nn as nn

from .base import FamilyAdapter


class Gemma3TextAdapter(FamilyAdapter):
    model_types = ("gemma3_text",)

    def layer_windows(self, model: nn.Module) -> list[int | None]:
        window = model.args.sliding_window
        return [window if layer.self_attn.is_sliding else None for layer in model.layers]
