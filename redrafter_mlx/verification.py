"""Lossless verification of a drafted tree against the LLM's own choices.

Every packed tree node gets one *target* token from the LLM's distribution at that node:

- greedy: the argmax of the LLM's logits;
- sampling: one independent draw from the LLM's processed distribution (temperature, top-p,
  min-p, top-k applied exactly as mlx-lm's sampler applies them).

A drafted token is accepted when it equals its parent's target. The accepted path is the
longest run of accepted tokens down any beam; the step emits the accepted drafted tokens and
then the target of the last accepted node (so every step yields ``accepted + 1`` tokens).

Why this is exact. Walk down the tree from the root: at node u draw x ~ P(. | u); if a child of
u carries x, move into it, else emit x and stop. Each emitted token is a draw from the LLM's
distribution given everything emitted before it, i.e. exactly autoregressive sampling. Drawing
a target at *every* node up front changes nothing: the draws are independent, and the walk only
ever reads the draws of the nodes it visits, each once. Children of a node carry distinct
tokens (packing merged equal prefixes), so "the child whose token is x" is unique, and it lies
on the longest accepted run. Greedy is the same walk with argmax in place of the draw, so it
reproduces greedy decoding token for token. Unlike the accept-if-U<P/Q rule of Apple's code,
nothing here depends on the draft distribution Q: drafts are deterministic beams, and a
deterministic proposal needs no correction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler settings; ``temp == 0`` means greedy."""

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temp < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temp}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must lie in [0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    @property
    def host_drawable(self) -> bool:
        """Temperature and top-p only: :func:`host_draw` can draw it."""
        return self.temp > 0 and self.min_p == 0.0 and self.top_k == 0


def sampling_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """The logits mlx-lm's ``make_sampler`` samples from, for rows of raw logits [..., V].

    mlx-lm normalises to log-probabilities, applies top-p, then min-p, then top-k (each masks
    tokens to -inf), and draws ``categorical(logprobs / temp)``.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temp)


NUCLEUS_CANDIDATES = 1024  # the likeliest tokens a top-p nucleus is looked for among


def nucleus(
    logprobs: mx.array, top_p: float, candidates: int = NUCLEUS_CANDIDATES
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """mlx-lm's top-p set, found among the ``candidates`` likeliest tokens of each row.

    ``apply_top_p`` sorts the whole vocabulary, which costs more than a forward's LM head on
    the CPU (~10 ms for 152k tokens); a nucleus at top-p 0.95 usually holds a few tokens.
    Same rule on the k largest, sorted descending: token j (1-based) is kept while the mass
    of the j - 1 tokens above it is below ``top_p`` times the total, and every token at least
    as likely as the last one kept is kept. That decides the row exactly unless the nucleus
    may reach past the k candidates: all k kept, or the last kept tied with the k-th.

    logprobs: [n, V]. Returns ids [n, k] (likeliest first), their logprobs [n, k], keep [n, k]
    and exact [n] (the row's nucleus is ``ids[keep]``; elsewhere fall back to the full sort).
    """
    V = logprobs.shape[-1]
    k = min(candidates, V)
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    probs = mx.exp(vals.astype(mx.float32))
    total = mx.exp(logprobs.astype(mx.float32)).sum(axis=-1, keepdims=True)
    mass_above = mx.cumsum(probs, axis=-1, inclusive=False)
    n_kept = (mass_above < top_p * total).sum(axis=-1, keepdims=True)  # >= 1: the top token
    threshold = mx.take_along_axis(vals, n_kept - 1, axis=-1)
    keep = vals >= threshold
    exact = (n_kept[:, 0] < k) & (threshold[:, 0] > vals[:, -1])
    if k == V:
        exact = mx.ones_like(exact)
    return ids, vals, keep, exact


def sample_rows(
    logits: mx.array, params: SamplingParams, candidates: int = NUCLEUS_CANDIDATES
) -> mx.array:
    """One draw per row from mlx-lm's processed distribution. logits: [n, V] -> [n] int32.

    With top-p alone (no min-p, no top-k) the draw is made among the nucleus's candidates
    (:func:`nucleus`); rows it cannot decide exactly are drawn again the full way. Whether a
    row falls back depends on its logits only, never on the draw, so the law is unchanged.
    """
    if params.greedy:  # argmax of the log-probabilities, as mlx-lm's greedy sampler takes it
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if 0 < params.top_p < 1.0 and params.min_p == 0.0 and params.top_k == 0:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ids, vals, keep, exact = nucleus(logprobs, params.top_p, candidates)
        z = mx.where(keep, vals * (1.0 / params.temp), -float("inf"))
        draw = mx.take_along_axis(ids, mx.random.categorical(z, axis=-1)[:, None], axis=-1)
        mx.eval(draw, exact)
        if exact.all().item():
            return draw[:, 0].astype(mx.int32)
    return mx.random.categorical(sampling_logits(logits, params), axis=-1).astype(mx.int32)


def node_targets(logits: mx.array, params: SamplingParams) -> mx.array:
    """One target token per tree node. logits: [n, V] -> [n] int32."""
    return sample_rows(logits, params)


#: float32 logits closer than this to a row's maximum could round to the same log-probability
#: as it (|logprob| <= log V < 16 there, whose rounding error is below 2^-19); generous.
NEAR_TIE = 1e-3


def greedy_targets(logits: mx.array) -> tuple[mx.array, mx.array]:
    """The greedy target of every node without mlx-lm's log-softmax, and whether to distrust it.

    mlx-lm's greedy sampler takes ``argmax(logits - logsumexp(logits))``; on the CPU the
    log-sum-exp costs ~2 ms per row of a 152k vocabulary, ten times the argmax. Subtracting
    the same number from a row keeps its order except that values closer than a rounding error
    may become equal (then the first index wins), so the argmax of the logits is mlx-lm's
    token unless some other logit lies within ``NEAR_TIE`` of the row's maximum. Returns
    (targets [n] int32, unsure [] bool): when ``unsure`` is set the caller must use
    :func:`node_targets` instead. float32 logits only (lower precisions round too coarsely).
    logits: [n, V].
    """
    if logits.dtype != mx.float32:
        raise ValueError(f"greedy_targets needs float32 logits, got {logits.dtype}")
    top = mx.argmax(logits, axis=-1)
    best = mx.take_along_axis(logits, top[:, None], axis=-1)  # [n, 1]
    unsure = mx.any((logits >= best - NEAR_TIE) & (logits < best))
    return top.astype(mx.int32), unsure


#: Relative margin within which :func:`host_nucleus` leaves a decision to mlx-lm's float32
#: arithmetic: log-probabilities there (|x| < 16) round by less than 2e-6, masses by less.
ROUNDING_MARGIN = 1e-4
#: :func:`host_nucleus` looks for the top-p set among the tokens at least this likely relative to
#: the likeliest (``exp(logit - max)``). A set reaching further is always left to MLX anyway: the
#: candidates' mass, at least the likeliest's 1, is then below the target, so the margin's band
#: around the target (2 * ROUNDING_MARGIN * target > 2e-4) is wider than the last kept token's
#: step of the running mass (< NUCLEUS_FLOOR), and one of the masses beside the edge lies in it.
NUCLEUS_FLOOR = 1e-4


def nucleus_among(
    e: np.ndarray, logits: np.ndarray, lo: float, hi: float, outside: float = 0.0
) -> np.ndarray | None:
    """mlx-lm's top-p rule on candidate tokens: which of them it keeps, likeliest first.

    e: [k] float32 ``exp(logit - row max)`` of the candidates, logits: [k] their float32
    logits (tokens tie only where these are equal); lo <= hi: bounds on ``top_p``
    times the row's total mass (``e`` summed over every token of the vocabulary); outside: an
    upper bound on ``e`` of every token that is not a candidate (0: all tokens are), below the
    likeliest candidate's. Token j (likeliest first) is kept while the mass above it is below
    ``top_p`` times the total, with every token at least as likely as the last one kept.

    Returns indices into ``e`` (likeliest first, equals by index); an empty array where the
    set may reach past the candidates (every one of them kept, and their mass below the
    target's upper bound); None where float32 rounding
    could decide it (mlx-lm decides in float32 log-probabilities, where tokens closer than a
    rounding error tie: a token that close to the set's edge, or a mass that close to the
    target; float32 ``e`` may round unequal logits to one value) or where the target's bounds
    are too far apart to decide it.
    """
    probs = e.astype(np.float64)
    order = np.argsort(-probs, kind="stable")
    probs = probs[order]
    # [k + 1]: the mass above each candidate, then above the likeliest token outside them
    mass_above = np.concatenate([[0.0], np.cumsum(probs)])
    n_kept = int((mass_above[:-1] < hi).sum())  # >= 1: the likeliest token
    if n_kept == len(probs) and outside > 0 and mass_above[-1] < hi:
        return order[:0]
    last = probs[n_kept - 1]
    near = lo - mass_above[n_kept - 1] < ROUNDING_MARGIN * lo
    if n_kept < len(probs) or outside > 0:
        near |= mass_above[n_kept] - hi < ROUNDING_MARGIN * hi
    # a token within rounding of the last one kept that does not tie it exactly
    close = np.abs(probs - last) <= last * ROUNDING_MARGIN
    near |= bool(np.any(close & (logits[order] != logits[order[n_kept - 1]])))
    near |= outside >= last * (1 - ROUNDING_MARGIN)
    return None if near else order[probs >= last]


def host_nucleus(row: np.ndarray, top_p: float) -> np.ndarray | None:
    """mlx-lm's top-p set of one row of logits [V] (float32, NumPy): the kept token ids
    (likeliest first), or None where float32 rounding could decide it (then use
    :func:`sample_rows`).

    The rule of :func:`nucleus`, in NumPy: MLX's CPU ``exp`` is scalar (~2 ms for 152k logits,
    and top-p needs the total mass) where NumPy's is vectorised (~0.15 ms). The set is looked
    for among the tokens with ``exp(logit - max)`` at least ``NUCLEUS_FLOOR``
    (:func:`nucleus_among`); tokens below it are less likely than every candidate, so once the
    candidates hold ``top_p`` of the mass, the rest are dropped as the full sort would drop
    them (and where they do not, rounding could decide the set: see ``NUCLEUS_FLOOR``).
    """
    e = np.exp(row - row.max())  # [V] float32, the likeliest is 1
    target = top_p * e.sum(dtype=np.float64)
    inside = e >= NUCLEUS_FLOOR
    ids = np.flatnonzero(inside)
    kept = nucleus_among(e[ids], row[ids], target, target, float(e[~inside].max(initial=0.0)))
    return ids[kept] if kept is not None and len(kept) else None


def draw_among(logits: np.ndarray, temp: float, rng: np.random.Generator) -> int:
    """Index of one draw from ``exp(logit / temp)`` over ``logits`` [k] (float32, NumPy)."""
    logits = logits.astype(np.float64)
    weights = np.exp((logits - logits.max()) / temp)
    cdf = np.cumsum(weights)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)


def host_draw(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int | None:
    """One draw from mlx-lm's processed distribution of one row of logits [V], in NumPy, or None
    where :func:`host_nucleus` leaves the top-p set to float32 rounding.

    Temperature and top-p only (``params.host_drawable``): the law is ``exp(logit / temp)``
    over the top-p set (all tokens without top-p), as ``make_sampler`` draws it.
    """
    if not params.host_drawable:
        raise ValueError("host_draw handles temperature and top-p only; use sample_rows")
    if not 0 < params.top_p < 1.0:
        return draw_among(row, params.temp, rng)
    ids = host_nucleus(row, params.top_p)
    return None if ids is None else int(ids[draw_among(row[ids], params.temp, rng)])


#: A draw of row i that may decline (None): the nucleus screen's, in :func:`walk_targets`.
ScreenDraw = Callable[[int, np.random.Generator], int | None]


def draw_target(
    logits: mx.array,
    i: int,
    params: SamplingParams,
    rng: np.random.Generator | None = None,
    screen: ScreenDraw | None = None,
) -> int:
    """One draw from row ``i`` of logits [n, V]: by ``screen`` (with ``rng``) where given and
    it decides the row, else in NumPy (:func:`host_draw`) when ``rng`` is given and the row
    allows it, else with :func:`sample_rows` (a host sync). The logits are evaluated only
    where the screen leaves the row to them."""
    if screen is not None and rng is not None:
        draw = screen(i, rng)
        if draw is not None:
            return draw
    if rng is not None and params.host_drawable and logits.dtype == mx.float32:
        draw = host_draw(np.asarray(logits)[i], params, rng)  # a view, no copy
        if draw is not None:
            return draw
    return int(sample_rows(logits[i : i + 1], params).item())


def walk_targets(
    logits: mx.array,
    children: list[dict[int, int]],
    params: SamplingParams,
    rng: np.random.Generator | None = None,
    screen: ScreenDraw | None = None,
) -> mx.array:
    """Sampling targets drawn only at the nodes the walk visits; ``-1`` elsewhere.

    The same walk as above, run on the host: draw at the root; while a child carries the draw,
    move there and draw again. Every visited node gets an independent draw from its own
    processed distribution, exactly as :func:`node_targets` would give it, so the emitted
    tokens follow the same law. What changes is the cost: mlx-lm's top-p sorts the whole
    vocabulary, per row, and only the visited rows (accepted + 1 of them) are processed instead
    of all n. With ``rng`` and temperature/top-p sampling the draws are made in NumPy on the
    evaluated logits (:func:`host_draw`, no device work); otherwise (and for a row whose top-p
    set float32 rounding could decide) each visited row is drawn with :func:`sample_rows`, at
    one host sync per visited node. ``screen`` (with ``rng``: the draw of
    :class:`~redrafter_mlx.nucleus_screen.ScreenedNucleus`) draws each visited row first,
    exactly as :func:`host_draw` would, and leaves the rows it cannot decide to the logits,
    which are then evaluated. ``-1`` equals no token, so :func:`accept` stops where the walk
    stopped. logits: [n, V] (lazy or evaluated); children: from
    :meth:`~redrafter_mlx.tree_attention.PackedTree.children`. Returns [n] int32.
    """
    targets = [-1] * len(children)
    node = 0
    while node is not None:
        targets[node] = draw_target(logits, node, params, rng, screen)
        node = children[node].get(targets[node])
    return mx.array(targets, dtype=mx.int32)


@dataclass
class Acceptance:
    """Device arrays describing one step's outcome (nothing here forces a sync)."""

    beam: mx.array  # [] int32, the beam holding the accepted path (lowest index on ties)
    count: mx.array  # [] int32, tokens emitted this step: accepted drafts + 1
    tokens: mx.array  # [L] int32, emitted tokens in order; entries past count are padding
    path: mx.array  # [L] int32, packed indices of the accepted beam, root first
    last: mx.array  # [] int32, packed index of the last accepted node


def accept(beams: mx.array, unpacker: mx.array, targets: mx.array) -> Acceptance:
    """Longest accepted prefix over all beams.

    beams: [W, L] drafted beams (column 0 is the root); unpacker: [W, L] packed index of each
    (beam, depth); targets: [n] the LLM's target at each packed node.
    """
    W, L = beams.shape
    parent_targets = targets[unpacker[:, :-1]]  # [W, L-1]: the LLM's choice after each prefix
    match = (beams[:, 1:] == parent_targets).astype(mx.int32)
    accepted = mx.cumprod(match, axis=1).sum(axis=1)  # [W] accepted drafted tokens per beam
    beam = mx.argmax(accepted).astype(mx.int32)  # first maximum: lowest beam index
    n_acc = accepted[beam]
    path = unpacker[beam]
    last = path[n_acc]
    drafted = mx.concatenate([beams[beam, 1:], mx.zeros((1,), mx.int32)])
    tokens = mx.where(mx.arange(L) == n_acc, targets[last], drafted)
    return Acceptance(
        beam=beam, count=(n_acc + 1).astype(mx.int32), tokens=tokens, path=path, last=last
    )
