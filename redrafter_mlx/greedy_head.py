"""Exact greedy targets without streaming the float32 LM head: an int8 screen, then a recount.

Greedy verification needs the argmax of each node's logits, not the logits. On the CPU a
forward is bound by the bytes of weights it streams, and the LM head is a large share of them
(Qwen2.5-0.5B: 151936 x 896 float32, 545 MB of the ~2 GB a forward reads). So the head is
applied in two passes:

1. **screen**: logits from an int8 copy of the head (one scale per row; 136 MB) times the
   hidden state rounded to int16 (one scale per row), summed exactly in integers, each with a
   proven bound on its distance from the float32 logit (Cauchy-Schwarz, with the norms of the
   two rounding residuals and generous float32 summation terms; see :meth:`GreedyHead.targets`);
2. **recount**: the float32 logits of the few columns whose bound reaches the best lower
   bound (on real rows: 1-6 of 151936), computed by the few-row kernel with the very
   operations it uses for the whole product (:func:`redrafter_mlx._blas.head_exact`), so they
   are bit-identical to the logits mlx-lm would see.

The argmax over those columns (first index on ties) is the argmax over all of them, and the
near-tie rule of :func:`~redrafter_mlx.verification.greedy_targets` carries over: every column
left out is more than ``NEAR_TIE`` below the best. So the targets are exactly
``greedy_targets``' (and, when it is unsure, the caller falls back the same way). It is used
only where the kernel computes the head's product (Linux x86-64, float32, at most
``REDRAFTER_GEMM_ROWS`` rows): elsewhere the logits come from another BLAS or from Metal, and
their rounding is not the recount's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import _blas
from .verification import NEAR_TIE

#: Columns the recount takes before it gives up (a flat row, e.g. a broken checkpoint): the
#: caller then computes the full logits.
MAX_RECOUNT = 4096


def head_weight(model: nn.Module) -> mx.array | None:
    """The float32 [V, H] weight ``lm_head`` multiplies by, or None if the head is anything but
    a plain product with it (a bias, quantized weights, another dtype)."""
    layer = model.get("lm_head") if "lm_head" in model else model.model.get("embed_tokens")
    if not isinstance(layer, nn.Linear | nn.Embedding) or "bias" in layer:
        return None
    weight = layer.get("weight")
    if weight is None or weight.dtype != mx.float32 or weight.ndim != 2:
        return None
    return weight


def _numpy(a: mx.array) -> np.ndarray:
    """A NumPy view of an evaluated MLX array (no copy when it is contiguous)."""
    mx.eval(a)
    return np.ascontiguousarray(np.asarray(memoryview(a)))


class GreedyHead:
    """The int8 screen of one LM head weight and its error bounds (see the module docstring).

    Costs ~V x H bytes (a quarter of the float32 head) and ~0.8 s to build (Qwen2.5-0.5B's).
    """

    def __init__(self, weight: mx.array):
        self.weight = _numpy(weight)  # [V, H] float32, a view of the model's
        V, H = self.weight.shape
        # The kernel's float32 summation error is at most (H + 1) u sum|w_k h_k| <=
        # (H + 1) u ||w|| ||h|| (u = 2^-24); doubled, to spare.
        gamma = 2 * (H + 2) * 2.0**-24
        quantized = _blas.head_quantize(self.weight)  # one pass in C, norms in float64
        self.finite = quantized is not None  # a NaN or inf weight: the bounds mean nothing
        if quantized is None:
            return
        self.q, self.scale, norms = quantized  # [V, H] int8, [V], [V, 3]
        # ||w_j - scale_j q_j|| + the kernel's error; ||scale_j q_j||
        self.residual = _up(norms[:, 0] + gamma * norms[:, 2])
        self.qnorm = _up(norms[:, 1])

    @property
    def nbytes(self) -> int:
        """Memory the screen adds to the model's (the float32 head is the model's own)."""
        return self.q.nbytes + self.scale.nbytes + self.residual.nbytes + self.qnorm.nbytes

    @classmethod
    def for_model(cls, model: nn.Module) -> GreedyHead | None:
        """The model's screen (built once and kept on it), or None where it cannot be exact:
        no few-row kernel here, or a head that is not a plain float32 product."""
        weight = head_weight(model)
        if weight is None or not _blas.kernel_takes(1, *weight.shape):
            return None
        head = getattr(model, "_redrafter_greedy_head", None)
        if head is None or head.source is not weight:
            head = cls(weight)
            head.source = weight
            model._redrafter_greedy_head = head  # a plain attribute: not a parameter
        return head if head.finite else None

    def usable(self, rows: int) -> bool:
        """Whether the model's own head product over ``rows`` rows runs in the kernel (whose
        arithmetic the recount repeats)."""
        return _blas.kernel_takes(rows, *self.weight.shape)

    def screen(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The screen's logits [n, V] of float32 hidden states x [n, H], and for each a bound
        on its distance from the float32 logit the kernel computes (both float32)."""
        # h = hq + dh with hq = x_scale * x16: logit_j - screen_j = (w_j - wq_j) . h
        # + wq_j . dh + float32 rounding, so |logit_j - screen_j| <= residual_j ||h|| +
        # qnorm_j ||dh|| (+ the screen's three roundings, which `targets` leaves room for).
        x64 = x.astype(np.float64)
        x16, x_scale = _blas.int16_rows(x64)
        dh = np.linalg.norm(x64 - x16 * x_scale[:, None].astype(np.float64), axis=1)
        hn = np.linalg.norm(x64, axis=1)
        logits = _blas.head_screen(x16, x_scale, self.q, self.scale)  # [n, V]
        eps = self.residual[None, :] * _up(hn)[:, None] + self.qnorm[None, :] * _up(dh)[:, None]
        eps *= np.float32(1 + 1e-3)  # float32 rounding of this product and of sums with it
        return logits, eps

    def targets(self, hidden: mx.array) -> tuple[np.ndarray, bool] | None:
        """Greedy targets [n] (int32) of hidden states [n, H] and whether a near tie makes them
        unsure, exactly as :func:`~redrafter_mlx.verification.greedy_targets` gives them; or
        None where the screen cannot decide (non-finite states, too many columns to recount)."""
        x = _numpy(hidden.astype(mx.float32))
        if not np.isfinite(x).all():
            return None
        screen, eps = self.screen(x)
        rows = np.arange(len(x))
        top = screen.argmax(axis=1)
        lower = screen[rows, top] - eps[rows, top]  # the row's best logit is no lower
        slack = 2.0**-18 * (np.abs(lower) + eps[rows, top] + 1)
        # Every column left out is below the best by more than NEAR_TIE.
        reach = screen + eps >= (lower - NEAR_TIE - slack)[:, None]
        cols = np.flatnonzero(reach.any(axis=0)).astype(np.int32)  # ascending
        if len(cols) > MAX_RECOUNT:
            return None
        exact = _blas.head_exact(x, self.weight, cols)  # [n, len(cols)]
        pick = exact.argmax(axis=1)  # first of equals: the lowest column
        best = exact[rows, pick][:, None]
        unsure = bool(np.any((exact >= best - NEAR_TIE) & (exact < best)))
        return cols[pick], unsure


def _up(a: np.ndarray) -> np.ndarray:
    """float64 values as float32, rounded up."""
    return np.nextafter(np.asarray(a, np.float32), np.float32(np.inf))
