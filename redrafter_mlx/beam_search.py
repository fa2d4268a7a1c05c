"""Beam search over the recurrent drafter: W candidate continuations of length L.

Semantics follow Apple's ml-recurrent-drafter. ``length`` counts the guaranteed token ``g0``
(the LLM's own next token), so each beam holds ``length - 1`` drafted tokens. Initial beam
scores are ``[0, LOG_0, ...]`` so the first step expands beam 0 only; each step scores every
(beam, token) pair by beam log-probability plus the drafter's log-softmax, keeps the top
``width`` pairs (sorted, best first) and carries the parents' RNN states along.

Everything stays on the device: no host synchronisation happens here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .drafter import Drafter

#: A proposer maps (hidden [H], g0 []) to beams [W, L] whose column 0 is g0, or to
#: (beams, prefix_scores [W, L]) when it also scores them (needed to prune the tree).
Proposer = Callable[[mx.array, mx.array], mx.array | tuple[mx.array, mx.array]]

#: Apple's "log 0": finite, so that when fewer than W candidates are finite (width above the
#: top-k, or a tiny vocabulary) the extra beams still extend with their best tokens (and
#: mostly duplicate prefixes, which packing merges) instead of arbitrary -inf ties.
LOG_0 = -50000.0


@dataclass
class Beams:
    tokens: mx.array  # [W, L] int32, tokens[:, 0] == g0, best beam first
    scores: mx.array  # [W] float32, joint draft log-probability of each beam
    prefix_scores: mx.array  # [W, L] float32, log-probability of each beam's prefix by depth
    log_q: mx.array | None = None  # [W, L-1, V_d] per-step draft log-probs (if requested)


def top_k_warp(logits: mx.array, k: int, mask_value: float = -mx.inf) -> mx.array:
    """Keep the k largest logits of each row, set the rest to mask_value. logits: [..., V]."""
    if k >= logits.shape[-1]:
        return logits
    kth = mx.sort(mx.topk(logits, k, axis=-1), axis=-1)[..., :1]  # [..., 1], k-th largest
    return mx.where(logits < kth, mx.array(mask_value, logits.dtype), logits)


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    g0: mx.array,
    width: int,
    length: int,
    top_k: int | None = None,
    return_log_q: bool = False,
) -> Beams:
    """Draft ``width`` beams of ``length`` tokens (g0 included) from the LLM state ``hidden``.

    Args:
        drafter: the recurrent drafter.
        embed: the LLM's token embedding lookup (shared with the drafter).
        hidden: [H] (or [B, H] for B independent searches), the LLM's final hidden state at
            the position that produced g0.
        g0: [] (or [B]) int, the guaranteed token.
        top_k: optional top-k warp of the drafter logits before the log-softmax (Apple: 50).

    Returns beams [W, L] (or [B, W, L]), best first, with the drafter's log-probability of
    every prefix (``prefix_scores[..., d]``: the first d drafted tokens; column 0 is 0).
    """
    if width < 1 or length < 2:
        raise ValueError(f"beam search needs width >= 1 and length >= 2, got {width}, {length}")
    batched = hidden.ndim == 2
    hidden, g0 = hidden.reshape(-1, hidden.shape[-1]), g0.reshape(-1)
    B, H = hidden.shape
    W, dtype = width, drafter.dtype
    hidden = mx.broadcast_to(hidden[:, None].astype(dtype), (B, W, H))
    tokens = mx.broadcast_to(g0.astype(mx.int32)[:, None, None], (B, W, 1))
    state = mx.zeros((B, W, H), dtype=dtype)
    scores = mx.broadcast_to(mx.array([0.0] + [LOG_0] * (W - 1), dtype=mx.float32), (B, W))
    prefix = mx.zeros((B, W, 1), dtype=mx.float32)
    log_q = None
    for _ in range(length - 1):
        state = drafter.step(state, embed(tokens[..., -1]))
        logits = drafter.logits(hidden, state).astype(mx.float32)  # [B, W, V_d]
        if top_k is not None:
            logits = top_k_warp(logits, top_k, mask_value=LOG_0)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        V = logp.shape[-1]
        joint = (scores[..., None] + logp).reshape(B, W * V)
        if W < W * V:
            best = mx.argpartition(-joint, kth=W - 1, axis=-1)[:, :W]
        else:
            best = mx.broadcast_to(mx.arange(W * V), (B, W * V))
        top = mx.take_along_axis(joint, best, axis=-1)
        order = mx.argsort(-top, axis=-1)  # best first; deterministic
        best, scores = mx.take_along_axis(best, order, -1), mx.take_along_axis(top, order, -1)
        parent, token = best // V, best % V  # [B, W]
        token_ids = drafter.token_ids(token).astype(mx.int32)
        tokens = mx.concatenate([gather_beams(tokens, parent), token_ids[..., None]], axis=-1)
        prefix = mx.concatenate([gather_beams(prefix, parent), scores[..., None]], axis=-1)
        state = gather_beams(state, parent)
        if return_log_q:
            step_q = gather_beams(logp, parent)[:, :, None]
            log_q = (
                step_q
                if log_q is None
                else mx.concatenate([gather_beams(log_q, parent), step_q], axis=2)
            )
    if not batched:
        tokens, scores, prefix = tokens[0], scores[0], prefix[0]
        log_q = None if log_q is None else log_q[0]
    return Beams(tokens=tokens, scores=scores, prefix_scores=prefix, log_q=log_q)


def gather_beams(x: mx.array, parent: mx.array) -> mx.array:
    """x[b, parent[b, w], ...] for every (b, w). x: [B, W, ...], parent: [B, W]."""
    index = parent.reshape(*parent.shape, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, index, axis=1)


def make_proposer(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    width: int,
    length: int,
    top_k: int | None = None,
    compiled: bool = True,
    with_scores: bool = False,
    int8: bool = False,
    dtype: mx.Dtype | None = None,
) -> Proposer:
    """A proposer that runs :func:`beam_search` with fixed beam shape.

    ``with_scores`` makes it return ``(tokens, prefix_scores)``, what tree pruning
    (:mod:`redrafter_mlx.tree_budget`) ranks nodes by.

    ``int8`` (one beam, no scores): where the few-row kernel runs, draft from int8 copies of
    the drafter's weights (:mod:`redrafter_mlx.drafter_int8`; a quarter of the bytes, drafts
    that may differ where the drafter's logits nearly tie). The copies are taken now: use it
    for generation, not while the drafter is being trained.

    ``dtype`` (the LLM's compute dtype): the drafter is cast to it, in place, if and only if
    the search runs in floating point. The int8 copies read float16 weights exactly, so a
    shipped float16 drafter drafting that way stays float16 (half the resident bytes of a
    float32 cast); a float search beside a float32 LLM needs the cast (the CPU runs float16
    products several times slower).

    ``compiled`` traces the search once per input shape with ``mx.compile``, which fuses its
    many small element-wise ops (log-softmax, scores, gathers) into fewer kernels. The drafter's
    weights are passed as compile inputs, so later weight updates are seen; the LLM's embedding
    table is captured as a constant (it does not change during generation).
    """

    if int8 and width == 1 and not with_scores:
        from .drafter_int8 import Int8OneBeam

        one_beam = Int8OneBeam.for_drafter(drafter, embed, length)
        if one_beam is not None:
            return one_beam
    if dtype is not None and drafter.dtype != dtype:
        drafter.set_dtype(dtype)
        mx.eval(drafter.parameters())  # now, not inside the first draft's time and peak

    def propose(hidden: mx.array, g0: mx.array) -> mx.array | tuple[mx.array, mx.array]:
        beams = beam_search(drafter, embed, hidden, g0, width, length, top_k=top_k)
        return (beams.tokens, beams.prefix_scores) if with_scores else beams.tokens

    return mx.compile(propose, inputs=drafter.state) if compiled else propose
