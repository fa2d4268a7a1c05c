"""An mlx-lm model that can verify a token tree in one forward pass.

Three small interventions, no forked model files:

- every layer gets a :class:`~redrafter_mlx.kv_cache.TreeKVCache`, whose ``make_mask`` returns
  the tree's ``[past | tree]`` boolean mask during a tree forward;
- every attention's ``rope`` is wrapped by :class:`TreeRoPE`, which applies the original rope
  at per-token positions (``past + depth``) by moving the tokens onto the batch axis, so
  ``mx.fast.rope`` gets one offset per token. Outside our forwards the wrapper passes through;
- the model module's ``scaled_dot_product_attention`` (mlx-lm's shared helper, which every
  attention calls with its cache) is wrapped so that attention over a tree or a short chain in
  one of our caches runs :func:`~redrafter_mlx.tree_attention.attend`; every other call passes
  through unchanged;
- the model module's ``swiglu`` (mlx-lm's MLP activation, where the family uses it) is wrapped
  so that inside our forwards it runs :func:`~redrafter_mlx.swiglu.host_swiglu`, the same
  values 8 floats at a time; outside them (mlx-lm's own decoding) it passes through.

The forward returns the hidden states after the final norm; the drafter needs them and the
logits are one ``lm_head`` away.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from .adapters import FamilyAdapter, adapter_for
from .kv_cache import WINDOW_SLACK, TreeContext, TreeKVCache
from .swiglu import host_swiglu, mlx_lm_swiglu
from .tree_attention import attend

#: Longest run of new tokens whose attention :func:`attend` computes; longer ones (prompt
#: chunks) keep mlx-lm's path, which does not hold all n x S scores at once.
MAX_ATTEND_TOKENS = 64


class TreeRoPE(nn.Module):
    """Apply the wrapped rope at the positions of the forward pass in progress."""

    def __init__(self, rope: nn.Module, context: TreeContext):
        super().__init__()
        self.rope = rope
        self._context = context  # underscored: not a child module or parameter

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        positions = self._context.positions
        if positions is None:
            return self.rope(x, offset=offset)
        if isinstance(positions, int):
            return self.rope(x, offset=positions)
        # x: [1, heads, n, D] -> [n, heads, 1, D]: one rope offset per token.
        return self.rope(x.swapaxes(0, 2), offset=positions).swapaxes(0, 2)


def _routed_attention(original: Callable) -> Callable:
    """mlx-lm's ``scaled_dot_product_attention``, sending our tree forwards to :func:`attend`."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if (
            sinks is None
            and isinstance(cache, TreeKVCache)
            and cache.context.positions is not None
            and 1 < queries.shape[2] <= MAX_ATTEND_TOKENS
            and (mask is None or isinstance(mask, str) or mask.ndim == 2)
        ):
            return attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.redrafter_original = original
    return scaled_dot_product_attention


def _route_attention(attention: nn.Module) -> None:
    module = sys.modules[type(attention).__module__]
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is not None and not hasattr(original, "redrafter_original"):
        module.scaled_dot_product_attention = _routed_attention(original)


#: Forwards of ours in progress (TreeLLM.hidden_states); the swiglu wrapper acts only then.
_our_forwards = 0


def _routed_swiglu(original: Callable) -> Callable:
    """mlx-lm's ``swiglu``, computed by :func:`host_swiglu` inside our forwards."""

    def swiglu(gate, x):
        if _our_forwards:
            out = host_swiglu(gate, x)
            if out is not None:
                return out
        return original(gate, x)

    return swiglu


def _route_swiglu(layer: nn.Module) -> None:
    mlp = getattr(layer, "mlp", None)
    module = sys.modules[type(mlp).__module__] if mlp is not None else None
    if module is not None and getattr(module, "swiglu", None) is mlx_lm_swiglu:
        module.swiglu = _routed_swiglu(mlx_lm_swiglu)


class TreeLLM:
    """Wraps an mlx-lm model (patched in place, behaviour unchanged outside tree forwards)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapter: FamilyAdapter = adapter_for(model)
        existing = getattr(model, "_redrafter_context", None)
        if existing is not None:  # already patched by another TreeLLM: share its context
            self.context = existing
        else:
            self.context = TreeContext()
            for attn in self.adapter.attention_modules(model):
                attn.rope = TreeRoPE(attn.rope, self.context)
                _route_attention(attn)
            for layer in model.layers:
                _route_swiglu(layer)
            model._redrafter_context = self.context
        self.windows = self.adapter.layer_windows(model)
        self.embed_tokens = self.adapter.embed_tokens(model)

    def make_cache(self, window_slack: int = WINDOW_SLACK) -> list[TreeKVCache]:
        return [TreeKVCache(self.context, window=w, slack=window_slack) for w in self.windows]

    def embed(self, tokens: mx.array) -> mx.array:
        """The LLM's input embedding lookup (what the drafter shares)."""
        return self.embed_tokens(tokens)

    def hidden_states(
        self,
        tokens: mx.array,
        cache: list[TreeKVCache],
        positions: int | mx.array,
        ancestors: mx.array | None = None,
    ) -> mx.array:
        """Run the model over new tokens and return their final hidden states.

        tokens: [N] ids. positions: the absolute position of tokens[0] for a causal chain, or
        [N] per-token positions for a tree whose [N, N] ``ancestors`` mask is given.
        Returns [N, H].
        """
        global _our_forwards
        ctx = self.context
        ctx.positions, ctx.ancestors = positions, ancestors
        _our_forwards += 1
        try:
            h = self.adapter.hidden_states(self.model, tokens[None], cache)
        finally:
            ctx.positions = ctx.ancestors = None
            _our_forwards -= 1
        if ancestors is None:
            for c in cache:
                c.drop_outside_window()
        return h[0]

    def logits(self, hidden: mx.array) -> mx.array:
        """[..., H] -> [..., V] logits in the model's dtype (as mlx-lm's sampler sees them)."""
        return self.adapter.lm_head(self.model, hidden)
