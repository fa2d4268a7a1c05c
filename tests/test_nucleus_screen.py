"""The nucleus screen (redrafter_mlx/nucleus_screen.py): exact top-p draws from the int8 screen.

Its nucleus is checked against :func:`host_nucleus` on the full float32 logits, its draws
against :func:`host_draw` with the same generator, its one-pass C helper against NumPy, and the
engine with the screen against the engine without it (same seed, same tokens).
"""

import math

import redrafter_mlx  # noqa: F401  (first: loads the kernel and the BLAS)
from redrafter_mlx import _blas
from redrafter_mlx import nucleus_screen as ns
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.generate import stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.nucleus_screen import ScreenedNucleus
from redrafter_mlx.verification import SamplingParams, host_draw, host_nucleus, nucleus_among

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_top_p
from tiny_models import head_screen_of, record_calls, tiny_drafter, tiny_llm

pytestmark = pytest.mark.skipif(
    _blas.gemm != "on", reason=f"the few-row GEMM kernel is not on here ({_blas.gemm})"
)

TOP_P = SamplingParams(temp=0.7, top_p=0.95)


def llm_like(rng, v: int, h: int, n: int, peak: float) -> tuple[np.ndarray, np.ndarray]:
    """Head weights and states whose logits have a few likely tokens over a long tail."""
    w = rng.standard_normal((v, h), dtype=np.float32) * np.float32(0.05)
    x = rng.standard_normal((n, h), dtype=np.float32) * np.float32(3)
    for r in range(n):  # a few columns aligned with each state
        for c in rng.choice(v, int(rng.integers(1, min(v, 5) + 1)), replace=False):
            w[c] += x[r] * np.float32(rng.uniform(0, peak) / (x[r] @ x[r]))
    return w, x


@settings(max_examples=30, deadline=None)
@given(
    v=st.integers(2, 4000),
    h=st.sampled_from([128, 136, 200]),
    n=st.integers(1, 4),
    peak=st.sampled_from([2.0, 8.0, 20.0, 40.0]),
    top_p=st.sampled_from([0.37, 0.8, 0.95, 0.99]),
    seed=st.integers(0, 2**16),
)
def test_screened_nucleus_and_draws_are_host_draws(v, h, n, peak, top_p, seed):
    """Wherever the screen decides a row, its set and logits are host_nucleus' on the full
    float32 row (which the kernel computes), and its draw is host_draw's with the same
    generator state; it may leave a row to the logits, never decide one differently."""
    rng = np.random.default_rng(seed)
    w, x = llm_like(rng, v, h, n, peak)
    head = head_screen_of(w)
    params = SamplingParams(temp=0.7, top_p=top_p)
    logits = np.array(mx.array(x) @ mx.array(w).T)  # what mlx-lm computes (in the kernel)
    screen = ScreenedNucleus(head, mx.array(x), params)
    for i in range(n):
        found = screen.nucleus(i)
        if found is None:
            continue
        ids, kept_logits = found
        want = host_nucleus(logits[i], top_p)
        assert want is not None  # the screen's margins include host_nucleus' own
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(kept_logits, logits[i][want])
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        assert screen.draw(i, a) == host_draw(logits[i], params, b)


def test_the_screen_decides_llm_like_rows():
    """Peaked rows over a long tail (as an LLM's mostly are) are decided by the screen."""
    rng = np.random.default_rng(0)
    w, x = llm_like(rng, 30_000, 256, 6, 30.0)
    head = head_screen_of(w)
    logits = np.array(mx.array(x) @ mx.array(w).T)
    screen = ScreenedNucleus(head, mx.array(x), TOP_P)
    decided = [screen.nucleus(i) for i in range(6)]
    assert sum(d is not None for d in decided) >= 5
    for i, d in enumerate(decided):
        if d is not None:
            np.testing.assert_array_equal(d[0], host_nucleus(logits[i], TOP_P.top_p))


def test_a_nucleus_reaching_below_the_candidates_is_left_to_mlx():
    """One likely token over 3000 each ~e^-10 as likely (below FLOOR): together they hold an
    eighth of the mass, so the nucleus takes most of them. Both the screen and host_nucleus
    leave the row to MLX (its edge is then always within rounding: see NUCLEUS_FLOOR); the
    screen must not return the one candidate it recounted."""
    rng = np.random.default_rng(4)
    w = np.zeros((3000, 128), np.float32)
    w[:, 0] = -1 + rng.uniform(-0.05, 0.05, 3000).astype(np.float32)
    w[123, 0] = 0.0
    x = np.zeros((1, 128), np.float32)
    x[0, 0] = 10.0
    logits = np.array(mx.array(x) @ mx.array(w).T)
    lp = mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True)
    assert (np.array(apply_top_p(lp, TOP_P.top_p)) > -np.inf).sum() > 1000
    assert host_nucleus(logits[0], TOP_P.top_p) is None
    assert ScreenedNucleus(head_screen_of(w), mx.array(x), TOP_P).nucleus(0) is None


def test_rows_the_screen_cannot_bound_are_left_to_the_logits():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((300, 128), dtype=np.float32)
    x = rng.standard_normal((2, 128), dtype=np.float32)
    x[1, 5] = np.nan
    screen = ScreenedNucleus(head_screen_of(w), mx.array(x), TOP_P)
    assert screen.nucleus(1) is None and screen.draw(1, np.random.default_rng(0)) is None
    flat = ScreenedNucleus(head_screen_of(np.ones((5000, 128), np.float32)), mx.array(x[:1]), TOP_P)
    assert flat.nucleus(0) is None  # every column ties: more than MAX_RECOUNT to recount
    with pytest.raises(ValueError, match="temperature and top-p only"):
        ScreenedNucleus(head_screen_of(w), mx.array(x), SamplingParams(temp=0.7))
    assert not ScreenedNucleus.takes(SamplingParams(temp=0.7, top_p=0.9, top_k=5))
    assert not ScreenedNucleus.takes(SamplingParams())


@settings(max_examples=60, deadline=None)
@given(
    v=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    offset=st.sampled_from([-0.5, -9.2, -30.0]),
    spread=st.sampled_from([1.0, 10.0, 60.0]),
    max_cols=st.integers(1, 64),
)
def test_screen_tail_is_numpys_pass(v, seed, offset, spread, max_cols):
    """The C pass gives NumPy's best, columns and largest left-out bound, and its sums within
    the 1e-5 per term that EXP_ROOM allows for (both AVX2 blocks and the scalar tail)."""
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal(v) * spread).astype(np.float32)
    eps = rng.uniform(0, 2, v).astype(np.float32)
    cols, (best, hi, lo, top) = _blas.screen_tail(s, eps, offset, max_cols)
    upper, lower = s + eps, s - eps
    assert best == lower.max()
    reach = upper >= np.float32(np.float32(best) + np.float32(offset))
    want = np.flatnonzero(reach)
    if len(want) > max_cols:
        assert cols is None
        return
    np.testing.assert_array_equal(cols, want)
    rest_hi = np.exp(upper[~reach].astype(np.float64) - best).sum()
    rest_lo = np.exp(lower[~reach].astype(np.float64) - best).sum()
    assert abs(hi - rest_hi) <= 1e-5 * rest_hi + 1e-37 * v
    assert abs(lo - rest_lo) <= 1e-5 * rest_lo + 1e-37 * v
    assert top == (upper[~reach].max() if (~reach).any() else -math.inf)


def test_screen_tail_exp_is_within_its_room_per_term():
    """Seven equal terms in one AVX2 block: the sum's error is each term's (MLX's float32 exp
    with the float32 rounding of its argument), swept over the left-out range."""
    worst = 0.0
    for x in np.linspace(-87.0, -9.2, 4001, dtype=np.float32):
        s = np.array([0.0] + [x] * 7, np.float32)
        _, (_, hi, lo, _) = _blas.screen_tail(s, np.zeros(8, np.float32), -9.0, 8)
        want = 7 * math.exp(float(x))
        worst = max(worst, abs(hi / want - 1), abs(lo / want - 1))
    assert worst < ns.EXP_ROOM / 10, worst


def test_nucleus_among_with_bounds_on_the_total():
    e = np.array([1.0, 0.5, 0.25, 0.125], np.float32)  # masses above: 0, 1, 1.5, 1.75, 1.875
    lg = np.log(e)

    def among(lo, hi, outside=0.0, k=4):
        return nucleus_among(e[:k], lg[:k], lo, hi, outside)

    np.testing.assert_array_equal(among(1.2, 1.4), [0, 1])
    assert among(0.9, 1.2) is None  # the target may lie on either side of 1
    assert len(among(1.9, 1.95, outside=0.01)) == 0  # may reach past them all
    np.testing.assert_array_equal(among(1.9, 1.95), [0, 1, 2, 3])  # no others
    np.testing.assert_array_equal(among(1.6, 1.7, outside=0.01), [0, 1, 2])
    # all candidates kept, but their mass is past the target: the next token is not kept
    np.testing.assert_array_equal(among(1.8, 1.85, outside=0.01), [0, 1, 2, 3])
    assert among(1.6, 1.7, outside=0.24999, k=3) is None  # ties the last one kept


@pytest.mark.parametrize("W,L,lookup", [(1, 3, 2), (2, 4, 0)])
def test_engine_with_the_screen_draws_the_same_tokens(W, L, lookup, monkeypatch):
    """Same seed, screen on or off: the same tokens, and the screen drew most of them."""
    model = tiny_llm("qwen2", vocab_size=3000, hidden_size=128, seed=1, scale=6.0, tie=True)
    llm = TreeLLM(model)
    draws = record_calls(monkeypatch, ScreenedNucleus, "draw")
    rng = np.random.default_rng(W * 10 + L)
    for k in range(3):
        prompt = rng.integers(0, 3000, int(rng.integers(2, 12))).tolist()
        drafter = tiny_drafter(128, 3000, seed=int(rng.integers(0, 100)))
        propose = make_proposer(drafter, llm.embed, W, L)
        runs = []
        for screen in (True, False):
            mx.random.seed(k)
            steps = stream_redrafter(
                llm, propose, prompt, max_tokens=30, sampling=TOP_P, lookup=lookup,
                head_screen=screen,
            )  # fmt: skip
            runs.append([t for o in steps for t in o.tokens])
        assert runs[0] == runs[1]
    drawn = [out is not None for out in draws]
    assert drawn and sum(drawn) >= 0.8 * len(drawn), (sum(drawn), len(drawn))


def test_the_engine_stops_screening_where_the_screen_keeps_falling_back(monkeypatch):
    """A screen that declines every row is tried for TRIAL_STEPS steps and then left off; the
    tokens are the same either way (each draw is host_draw's, from the same generator)."""
    assert ns.screen_pays(ns.TRIAL_STEPS - 1, ns.TRIAL_STEPS - 1)
    assert not ns.screen_pays(ns.TRIAL_STEPS, ns.TRIAL_STEPS)
    assert ns.screen_pays(30, 10) and not ns.screen_pays(30, 11)
    model = tiny_llm("qwen2", vocab_size=3000, hidden_size=128, seed=1, scale=6.0, tie=True)
    llm = TreeLLM(model)
    propose = make_proposer(tiny_drafter(128, 3000, seed=3), llm.embed, 1, 3)
    made = record_calls(monkeypatch, ScreenedNucleus, "__init__")
    monkeypatch.setattr(ScreenedNucleus, "nucleus", lambda self, i: None)
    runs = []
    for screen in (True, False):
        mx.random.seed(5)
        steps = stream_redrafter(
            llm, propose, [1, 2, 3], max_tokens=60, sampling=TOP_P, head_screen=screen
        )
        outs = list(steps)
        runs.append([t for o in outs for t in o.tokens])
    assert runs[0] == runs[1]
    assert outs[-1].summary.steps > 2 * ns.TRIAL_STEPS and len(made) == ns.TRIAL_STEPS
