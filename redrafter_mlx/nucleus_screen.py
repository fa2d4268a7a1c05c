"""Exact top-p draws without streaming the float32 LM head: the int8 screen finds the nucleus.

Sampling verification draws at the tree nodes the walk visits (:func:`~redrafter_mlx.
verification.walk_targets`), and a top-p draw needs exact logits only for the tokens that can
be in the nucleus. The LM head's int8 screen (:class:`~redrafter_mlx.greedy_head.GreedyHead`)
gives every logit within a proven bound, so for each visited row:

1. **candidates**: every token whose screened upper bound reaches ``FLOOR`` times the likeliest
   token's probability (``log FLOOR`` below the best lower bound). Every token at least that
   likely is among them, the likeliest too;
2. **recount**: their float32 logits, bit-identical to the full product's
   (:func:`redrafter_mlx._blas.head_exact`);
3. **nucleus**: :func:`~redrafter_mlx.verification.nucleus_among` on the candidates at least
   ``FLOOR`` as likely as the likeliest, the same candidate set
   :func:`~redrafter_mlx.verification.host_nucleus` looks among. The total mass, which sets
   where the nucleus ends, is exact over the candidates and bounded over the rest (each
   token's ``exp`` of its screened bounds, one pass in C: :func:`redrafter_mlx._blas.
   screen_tail`); the nucleus is taken only where both ends of that range, widened by the
   rounding margin, give the same set. Where they do not, the recount is retried once with
   every token that may be 1e-6 as likely, which narrows the range.

Top-p renormalises within the nucleus, so the draw needs no other logit: it is the draw
:func:`~redrafter_mlx.verification.host_draw` makes from the full row (same ids in the same
order, same logits, same generator), and with the same generator state it is the same token.
A row the screen cannot decide (the nucleus reaching below ``FLOOR``, the total's range
straddling its edge, too many candidates) returns None, and the caller draws it from the full
logits; that choice depends on the logits only, never on the draw, so the law is unchanged.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import _blas
from .greedy_head import MAX_RECOUNT, GreedyHead, _numpy
from .verification import NUCLEUS_FLOOR, SamplingParams, draw_among, nucleus_among

#: The nucleus is looked for among the tokens at least this likely relative to the likeliest, as
#: host_nucleus looks for it (a set reaching further is left to MLX by both).
FLOOR = NUCLEUS_FLOOR
#: The logits recounted: those that may be at least this likely relative to the likeliest,
#: then (where the bounded mass of the rest leaves the nucleus' edge open) the next floor.
RECOUNT_FLOORS = (FLOOR, 1e-6)
#: Absolute room (in logits) for the float32 rounding of the screen's bounds (~1e-5 at |30|).
CUSHION = 1e-2
#: Relative room for the float32 exp of the rest's terms (_blas.screen_tail: each within 1e-5,
#: the rounding of its argument included) and of exp(rest_top - m).
EXP_ROOM = 1e-4
#: Room for the terms the float32 exp rounds to 0 (below e^-88).
TINY = 1e-37
#: Relative room for float64 sums of the same terms in another order.
SUM_ROOM = 1e-9


#: Screened steps before :func:`screen_pays` judges the screen by its own record.
TRIAL_STEPS = 8
#: The share of screened steps that may still need the float32 logits (a row the screen left
#: to them): such a step pays for the screen and the head. On the 2-core Zen 1 the screen of
#: 3 rows costs ~60% of the head's product, so it loses once ~40% of the steps fall back.
MAX_FALLBACK_SHARE = 1 / 3


def screen_pays(screened: int, fell_back: int) -> bool:
    """Whether to screen the next step, given how many steps were screened and how many of
    them still needed the logits. The screen never changes a token (each draw is host_draw's,
    from the same generator), so this decides the cost only. The demo model's rows fall back
    in ~5-10% of the steps; Gemma 3 270M's, whose bounds are twice as wide and whose rows
    float32 rounding decides more often, in about half."""
    return screened < TRIAL_STEPS or fell_back <= MAX_FALLBACK_SHARE * screened


class ScreenedNucleus:
    """Top-p draws from rows of hidden states [n, H] through the LM head's int8 screen.

    The screen runs over all n rows at once, when the first row is drawn: on the 2-core Zen 1
    it costs ~11 ms for one row, 12.5 for two and 16 for three (the integer units bound it),
    so one pass costs less than screening the accepted + 1 rows the walk visits one by one.
    Each draw recounts only its own row's candidates.
    """

    def __init__(self, head: GreedyHead, hidden: mx.array, params: SamplingParams):
        if not self.takes(params):
            raise ValueError("the nucleus screen draws with temperature and top-p only")
        self.head, self.params = head, params
        self.x = _numpy(hidden.astype(mx.float32))  # [n, H]
        self.finite = np.isfinite(self.x).all(axis=1)  # [n]
        self._screen: tuple[np.ndarray, np.ndarray] | None = None  # logits, bounds [n, V]
        self.declined = 0  # draws left to the logits

    @staticmethod
    def takes(params: SamplingParams) -> bool:
        """Whether these settings draw by the screen: temperature and top-p (below 1) only."""
        return params.host_drawable and 0 < params.top_p < 1.0

    def nucleus(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Row i's top-p set as mlx-lm keeps it: ids (likeliest first) and their float32
        logits; None where the screen cannot decide it (see the module docstring)."""
        if not self.finite[i]:
            return None
        if self._screen is None:  # rows that are not finite are screened but never read
            self._screen = self.head.screen(np.nan_to_num(self.x))
        s, eps = (a[i] for a in self._screen)  # [V] float32 each
        for floor in RECOUNT_FLOORS:
            found = self._nucleus_at(i, s, eps, floor)
            if found is not None:
                return found
        return None

    def _nucleus_at(
        self, i: int, s: np.ndarray, eps: np.ndarray, floor: float
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`nucleus` with the logits recounted for every token that may be at least
        ``floor`` as likely as the likeliest: the nucleus is looked for among those at least
        ``FLOOR`` as likely, the mass of the others bounded."""
        # best <= the row's largest logit; each token left out is below exp(upper - best) < floor
        cols, (best, rest_hi, rest_lo, rest_top) = _blas.screen_tail(
            s, eps, math.log(floor) - CUSHION, MAX_RECOUNT
        )
        if cols is None:
            return None
        exact = _blas.head_exact(self.x[i : i + 1], self.head.weight, cols)[0]  # [k]
        m = exact.max()  # the row's largest logit: its column reaches the cut
        e = np.exp(exact - m)  # float32, as host_nucleus computes it
        shift = math.exp(best - float(m))  # the rest's sums were taken relative to best
        rest_hi = rest_hi * shift * (1 + EXP_ROOM) + len(s) * TINY
        rest_lo = rest_lo * shift * (1 - EXP_ROOM)
        total = float(e.sum(dtype=np.float64))  # summed in another order than host_nucleus'
        lo = self.params.top_p * (total + rest_lo) * (1 - SUM_ROOM)
        hi = self.params.top_p * (total + rest_hi) * (1 + SUM_ROOM)
        inside = e >= FLOOR
        outside = float(e[~inside].max(initial=0.0))
        if rest_top > -math.inf:  # some tokens were not recounted
            outside = max(outside, math.exp(rest_top - float(m)) * (1 + EXP_ROOM) + TINY)
        kept = nucleus_among(e[inside], exact[inside], lo, hi, outside)
        if kept is None or not len(kept):
            return None
        ids = np.flatnonzero(inside)[kept]
        return cols[ids], exact[ids]

    def draw(self, i: int, rng: np.random.Generator) -> int | None:
        """One draw from row i's processed distribution, or None (draw it from the logits)."""
        found = self.nucleus(i)
        if found is None:
            self.declined += 1
            return None
        ids, logits = found
        return int(ids[draw_among(logits, self.params.temp, rng)])
