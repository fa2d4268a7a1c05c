"""What the engine needs to know about an mlx-lm model family.

mlx-lm models expose ``model.model(inputs, cache)`` (the hidden state after the final norm),
``model.model.embed_tokens`` and either ``model.lm_head`` or tied embeddings. A family adapter
adds which layers use a sliding window and where each attention's rope lives. Model files are
never forked: the engine swaps each rope for a position-aware wrapper and gives every layer a
:class:`~redrafter_mlx.kv_cache.TreeKVCache`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class FamilyAdapter:
    #: mlx-lm ``model_type`` values this adapter supports.
    model_types: tuple[str, ...] = ()

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The attention module of every layer, in order (each has a ``rope``)."""
        return [layer.self_attn for layer in model.layers]

    def layer_windows(self, model: nn.Module) -> list[int | None]:
        """Sliding window of every layer (None: full attention)."""
        return [None] * len(model.layers)

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        """The input embedding table (shared with the drafter)."""
        return model.model.embed_tokens

    def hidden_states(self, model: nn.Module, inputs: mx.array, cache: list) -> mx.array:
        """[B, N] token ids -> [B, N, H] hidden states after the final norm."""
        return model.model(inputs, cache=cache)

    def output_embeddings(self, model: nn.Module) -> mx.array:
        """[V, H] rows of the output layer (dequantized), for training targets and init."""
        layer = model.lm_head if "lm_head" in model else model.model.embed_tokens
        if hasattr(layer, "scales"):
            return mx.dequantize(
                layer.weight,
                layer.scales,
                layer.get("biases"),
                layer.group_size,
                layer.bits,
                mode=getattr(layer, "mode", "affine"),
            )
        return layer.weight

    def lm_head(self, model: nn.Module, hidden: mx.array) -> mx.array:
        """[..., H] hidden states -> [..., V] logits, exactly as ``model.__call__`` does."""
        if "lm_head" in model:
            return model.lm_head(hidden)
        return model.model.embed_tokens.as_linear(hidden)
