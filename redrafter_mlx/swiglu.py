"""mlx-lm's ``swiglu`` in our forwards, bit for bit, 8 floats at a time.

MLX's CPU backend JIT-compiles ``silu(g) * u`` for baseline x86-64: one float at a time, its
``exp`` a Cephes polynomial of ``fmaf`` calls through the PLT. In a 3-token forward of
Qwen2.5-0.5B that activation took 7.3 ms of 92 (``python bench/forward_parts.py``), and a
tree pays it per token. The kernel library (``_skinny_gemm.c``) runs the very same operations
on 8 floats at once, so the values, the logits and the greedy tokens do not change. A check at
first use compares it with MLX's own on values of every scale and the special ones, and keeps
MLX's where they differ (another MLX version could change its ``exp``). The inputs must be on
the host: one synchronisation per layer, ~0.1 ms, against ~0.3 ms saved per layer at 3 tokens.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from . import _blas

_usable: bool | None = None  # decided by the first call


def _probe() -> tuple[np.ndarray, np.ndarray]:
    """Gate values of every magnitude from 1e-38 to 1e4 and both signs, MLX's clamps at +-88,
    and the special values; random up-projections."""
    rng = np.random.default_rng(0)
    mags = np.exp(rng.uniform(np.log(1e-38), np.log(1e4), 1 << 15))
    g = np.concatenate(
        [
            mags * rng.choice([-1.0, 1.0], mags.size),
            rng.uniform(-100, 100, 1 << 14),
            [0.0, -0.0, 88.0, -88.0, 88.5, -88.5, 1e-45, -1e-45, np.inf, -np.inf, np.nan],
        ]
    ).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    return g, u


def _check() -> bool:
    g, u = _probe()
    ours = _blas.swiglu(g, u)
    if ours is None:
        return False
    theirs = np.array(mlx_lm_swiglu(mx.array(g), mx.array(u)))
    same = (ours.view(np.uint32) == theirs.view(np.uint32)) | (np.isnan(ours) & np.isnan(theirs))
    if not same.all():
        print(
            f"redrafter-mlx: the vectorised swiglu differs from this MLX's in {np.sum(~same)} of "
            f"{same.size} probe values; using MLX's own (slower, same results)",
            file=sys.stderr,
        )
        return False
    return True


def usable() -> bool:
    """Whether :func:`host_swiglu` computes here, bit-identical to MLX (checked once)."""
    global _usable
    if _usable is None:
        _usable = _check()
    return _usable


def host_swiglu(gate: mx.array, x: mx.array) -> mx.array | None:
    """``silu(gate) * x`` as mlx-lm's ``swiglu`` computes it, on the host (evaluates both
    inputs), or None where it does not apply: not float32, shapes that broadcast, no kernel."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32 or gate.shape != x.shape:
        return None
    if not usable():
        return None
    mx.eval(gate, x)
    out = _blas.swiglu(np.ascontiguousarray(gate), np.ascontiguousarray(x))
    return None if out is None else mx.array(out)
