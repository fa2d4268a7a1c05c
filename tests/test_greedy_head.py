"""The LM head's int8 screen (redrafter_mlx/greedy_head.py): exact greedy targets.

The screen's bound is checked against the float32 products themselves, the targets against
:func:`greedy_targets` on MLX's logits, and the engine against mlx-lm's greedy decoding with
models wide enough for the few-row kernel to compute their heads.
"""

import os
import subprocess
import sys

import redrafter_mlx  # noqa: F401  (first: loads the kernel and the BLAS)
from redrafter_mlx import _blas
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.generate import stream_autoregressive, stream_redrafter
from redrafter_mlx.greedy_head import GreedyHead, head_weight
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.verification import NEAR_TIE, greedy_targets

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import head_screen_of, record_calls, tiny_drafter, tiny_llm

pytestmark = pytest.mark.skipif(
    _blas.gemm != "on", reason=f"the few-row GEMM kernel is not on here ({_blas.gemm})"
)


def weights(rng, v: int, h: int, ties: int) -> np.ndarray:
    """Random rows whose norms vary, some duplicated exactly or within NEAR_TIE's reach."""
    w = rng.standard_normal((v, h), dtype=np.float32) * rng.uniform(0.02, 0.3, (v, 1)).astype(
        np.float32
    )
    for _ in range(ties):
        a, b = rng.integers(0, v, 2)
        w[b] = w[a]
        if rng.random() < 0.5:  # a near tie: one weight nudged
            w[b, rng.integers(0, h)] += np.float32(rng.choice([1e-6, 1e-5, 1e-4]))
    return w


def states(rng, n: int, h: int, outlier: bool) -> np.ndarray:
    x = rng.standard_normal((n, h), dtype=np.float32) * np.float32(rng.uniform(0.5, 20))
    if outlier:  # a "massive activation": one coordinate far above the rest
        x[:, rng.integers(0, h)] *= np.float32(200)
    return x


@settings(max_examples=40, deadline=None)
@given(
    v=st.integers(1, 3000),
    h=st.sampled_from([128, 136, 200, 256]),  # the kernel takes H >= 128; tails of 16 and 32
    n=st.integers(1, 9),
    ties=st.integers(0, 20),
    outlier=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_screen_bounds_hold_and_targets_equal_greedy_targets(v, h, n, ties, outlier, seed):
    rng = np.random.default_rng(seed)
    w = weights(rng, v, h, ties)
    x = states(rng, n, h, outlier)
    if ties and v > 1:  # make some state's best logit tie another column's
        x[0] = w[rng.integers(0, v)] * np.float32(50)
    head = head_screen_of(w)
    logits = mx.array(x) @ mx.array(w).T  # what mlx-lm computes (in the kernel)
    exact = np.array(logits)
    screen, eps = head.screen(x)
    assert np.all(np.abs(screen.astype(np.float64) - exact) <= eps)

    want, want_unsure = greedy_targets(logits)
    got = head.targets(mx.array(x))
    assert got is not None
    targets, unsure = got
    assert unsure == bool(want_unsure.item())
    if not unsure:
        np.testing.assert_array_equal(targets, np.array(want))


def test_the_recount_is_bit_identical_to_the_full_product():
    rng = np.random.default_rng(0)
    for m, v, h in [(1, 5000, 896), (3, 2000, 896), (5, 777, 130), (8, 3000, 640)]:
        w = rng.standard_normal((v, h), dtype=np.float32)
        x = rng.standard_normal((m, h), dtype=np.float32)
        full = np.array(mx.array(x) @ mx.array(w).T)
        cols = np.sort(rng.choice(v, 50, replace=False)).astype(np.int32)
        np.testing.assert_array_equal(_blas.head_exact(x, w, cols), full[:, cols])


def test_near_ties_are_flagged_and_exact_ties_take_the_first_column():
    rng = np.random.default_rng(1)
    h = 128
    w = rng.standard_normal((400, h), dtype=np.float32) * np.float32(0.05)
    x = rng.standard_normal((2, h), dtype=np.float32)
    w[300] = x[0] * np.float32(0.2)  # row 0's clear winner ...
    w[17] = w[300]  # ... tied exactly by an earlier column
    head = head_screen_of(w)
    (targets, unsure) = head.targets(mx.array(x))
    assert not unsure and targets[0] == 17
    w[17, 0] += np.float32(NEAR_TIE / 4 / abs(x[0, 0]))  # now within NEAR_TIE, not equal
    head = head_screen_of(w)
    logits = mx.array(x) @ mx.array(w).T
    assert bool(greedy_targets(logits)[1].item())
    assert head.targets(mx.array(x))[1]


def test_what_the_screen_cannot_decide_is_left_to_mlx():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((300, 128), dtype=np.float32)
    head = head_screen_of(w)
    x = rng.standard_normal((2, 128), dtype=np.float32)
    x[1, 5] = np.nan
    assert head.targets(mx.array(x)) is None
    flat = head_screen_of(np.ones((5000, 128), np.float32))  # every column ties: too many
    assert flat.targets(mx.array(x[:1])) is None


def test_heads_it_cannot_reproduce_have_no_screen():
    assert head_weight(tiny_llm("qwen2", vocab_size=300, hidden_size=128, tie=True)) is not None
    biased = nn.Module()
    biased.lm_head = nn.Linear(128, 300, bias=True)
    assert head_weight(biased) is None
    half = nn.Module()
    half.lm_head = nn.Linear(128, 300, bias=False)
    half.lm_head.weight = half.lm_head.weight.astype(mx.float16)
    assert head_weight(half) is None
    quantized = nn.Module()
    quantized.lm_head = nn.QuantizedLinear(128, 300, bias=False)
    assert head_weight(quantized) is None
    narrow = tiny_llm("qwen2", vocab_size=300, hidden_size=32)  # K < 128: not the kernel's
    assert GreedyHead.for_model(narrow) is None
    broken = tiny_llm("llama", vocab_size=300, hidden_size=128)
    broken.lm_head.weight = mx.where(
        mx.arange(300)[:, None] == 7, mx.array(np.inf), broken.lm_head.weight
    )
    assert GreedyHead.for_model(broken) is None


SCREEN_CHILD = """
import sys
import redrafter_mlx
from redrafter_mlx import _blas
import numpy as np
rng = np.random.default_rng(3)
x16 = rng.integers(-16383, 16384, (5, 200)).astype(np.int16)
xs = rng.uniform(0.001, 0.01, 5).astype(np.float32)
q = rng.integers(-127, 128, (999, 200)).astype(np.int8)
s = rng.uniform(0.001, 0.01, 999).astype(np.float32)
np.save(sys.argv[1], _blas.head_screen(x16, xs, q, s))
"""


def test_avx512_and_avx2_screens_give_the_same_bits(tmp_path):
    """The screen sums in integers, so its two code paths agree exactly (where the CPU has
    AVX-512 VNNI; elsewhere both runs take the AVX2 path)."""
    out = []
    for env in ({}, {"REDRAFTER_NO_VNNI": "1"}):
        path = tmp_path / f"screen{len(out)}.npy"
        subprocess.run(
            [sys.executable, "-c", SCREEN_CHILD, str(path)],
            check=True,
            env={**os.environ, **env},
        )
        out.append(np.load(path))
    np.testing.assert_array_equal(out[0], out[1])
    rng = np.random.default_rng(3)
    x16 = rng.integers(-16383, 16384, (5, 200)).astype(np.int64)
    xs = rng.uniform(0.001, 0.01, 5).astype(np.float32)
    q = rng.integers(-127, 128, (999, 200)).astype(np.int64)
    s = rng.uniform(0.001, 0.01, 999).astype(np.float32)
    want = ((x16 @ q.T).astype(np.float32) * s[None, :]) * xs[:, None]
    np.testing.assert_array_equal(out[0], want)


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("llama", False), ("gemma3_text", True)])
@pytest.mark.parametrize("W,L,lookup", [(1, 3, 2), (2, 4, 0), (4, 3, 1)])
def test_engine_with_the_screen_equals_mlx_lm(family, tie, W, L, lookup, monkeypatch):
    kw = {} if family == "gemma3_text" else {"tie": tie}
    model = tiny_llm(family, vocab_size=512, hidden_size=128, seed=1, **kw)
    llm = TreeLLM(model)
    screened = record_calls(monkeypatch, GreedyHead, "targets")
    rng = np.random.default_rng(W * 10 + L)
    for _ in range(3):
        prompt = rng.integers(0, 512, int(rng.integers(2, 12))).tolist()
        want = [t for o in stream_autoregressive(model, prompt, max_tokens=40) for t in o.tokens]
        drafter = tiny_drafter(128, 512, seed=int(rng.integers(0, 100)))
        propose = make_proposer(drafter, llm.embed, W, L)
        got = [
            t
            for o in stream_redrafter(llm, propose, prompt, max_tokens=40, lookup=lookup)
            for t in o.tokens
        ]
        assert got == want
    assert screened and all(out is not None for out in screened)  # it decided every step


def test_quantized_weights_and_their_norms():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((300, 136), dtype=np.float32) * np.float32(0.1)
    w[7] = 0.0  # a zero row: scale 1, q 0
    q, scale, norms = _blas.head_quantize(w)
    assert scale[7] == 1.0 and not q[7].any()
    w64 = w.astype(np.float64)
    np.testing.assert_allclose(scale, np.where(np.abs(w).max(1) > 0, np.abs(w).max(1) / 127, 1))
    wq = q.astype(np.float64) * scale[:, None]
    assert np.all(np.abs(w64 - wq) <= scale[:, None] * (0.5 + 1e-6))  # rounded to nearest
    np.testing.assert_allclose(norms[:, 0], np.linalg.norm(w64 - wq, axis=1), rtol=1e-12)
    np.testing.assert_allclose(norms[:, 1], np.linalg.norm(wq, axis=1), rtol=1e-12)
    np.testing.assert_allclose(norms[:, 2], np.linalg.norm(w64, axis=1), rtol=1e-12)
    w[3, 4] = np.nan
    assert _blas.head_quantize(w) is None
