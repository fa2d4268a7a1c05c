"""A KV cache that can take a packed token tree and then keep just the accepted path.

mlx-lm models take their attention mask from ``cache.make_mask(...)``; this cache answers with
a boolean ``[past | tree]`` mask while a tree is being verified, so unmodified model files can
attend over a tree. After verification :meth:`TreeKVCache.commit` moves the accepted path's
entries into place and drops the rest, so the cache holds exactly prompt + accepted tokens.

Sliding-window layers (Gemma 3, Mistral-style ``layer_types``) get a *window* cache instead of
mlx-lm's ``RotatingKVCache``, whose multi-token updates and trims lose entries once the window
has filled (mlx-lm's own speculative decoding is wrong there). This one keeps its entries in
temporal order and drops the oldest only once at least ``window - 1`` newer ones remain, with
slack so the copy is rare; masks are built from absolute positions, so they stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

#: Entries a window cache may hold beyond ``window - 1`` before it drops the oldest.
WINDOW_SLACK = 256


@dataclass
class TreeContext:
    """What the forward pass in progress feeds the model; shared by all caches and ropes.

    ``positions`` is the absolute position of the first new token (an int, for a causal chain
    such as a prompt) or an [n] int32 array of per-token positions (a tree). ``ancestors`` is
    the [n, n] bool mask among the new tokens of a tree, or None for a causal chain.
    ``positions`` is None outside our forward passes, where everything behaves as in mlx-lm.
    """

    positions: int | mx.array | None = None
    ancestors: mx.array | None = None

    def query_positions(self, n: int) -> mx.array:
        if isinstance(self.positions, int):
            return mx.arange(self.positions, self.positions + n, dtype=mx.int32)
        return self.positions


class TreeKVCache(KVCache):
    """mlx-lm's KVCache plus tree masks, path commits and an optional sliding window.

    ``offset`` keeps mlx-lm's meaning (number of stored entries). Stored entry ``i`` holds
    absolute position ``start + i``; ``start`` stays 0 without a window.
    """

    def __init__(self, context: TreeContext, window: int | None = None, slack: int = WINDOW_SLACK):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.context = context
        self.window = window
        self.slack = slack  # extra entries a window cache holds before dropping the oldest
        self.start = 0

    @property
    def length(self) -> int:
        """Number of tokens seen so far (absolute position of the next token)."""
        return self.start + self.offset

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        ctx = self.context
        window = window_size or self.window
        if ctx.positions is None or (ctx.ancestors is None and window is None):
            # A causal chain on a full-attention layer: mlx-lm's own (fast) path.
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        q = ctx.query_positions(N)[:, None]  # [N, 1]
        past = mx.arange(self.start, self.start + self.offset, dtype=mx.int32)  # [P]
        if ctx.ancestors is not None:
            new = ctx.ancestors  # [N, N]
        else:
            new = mx.tril(mx.ones((N, N), dtype=mx.bool_))
        if window is None:
            past_mask = mx.ones((N, self.offset), dtype=mx.bool_)
        else:
            past_mask = (q - past[None, :]) < window
            new = new & ((q - ctx.query_positions(N)[None, :]) < window)
        return mx.concatenate([past_mask, new], axis=1)  # [N, P + N]

    def commit(self, path: mx.array | None, tree_size: int, keep: int) -> None:
        """Keep ``keep`` tokens of the tree just appended: those at packed indices ``path``.

        ``path`` [>= keep] lists packed indices root first; None means 0..keep-1 (already in
        place, as for beam 0 which owns all its tokens).
        """
        base = self.offset - tree_size
        if base < 0 or keep > tree_size:
            raise ValueError(f"cannot keep {keep} of a {tree_size}-token tree in this cache")
        if path is not None and keep > 1:
            idx = base + path[:keep].astype(mx.int32)
            self.keys[..., base : base + keep, :] = self.keys[..., idx, :]
            self.values[..., base : base + keep, :] = self.values[..., idx, :]
        self.offset = base + keep
        self.drop_outside_window()

    def drop_outside_window(self) -> None:
        """Forget entries no future token can see (window caches only; rarely copies)."""
        if self.window is None or self.offset <= self.window - 1 + self.slack:
            return
        drop = self.offset - (self.window - 1)
        self.keys = self.keys[..., drop:, :]
        self.values = self.values[..., drop:, :]
        self.offset -= drop
        self.start += drop
