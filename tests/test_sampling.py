"""Sampling preserves the LLM's distribution exactly: chi-square against the enumerated law."""

import itertools
from collections import Counter

from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.generate import stream_autoregressive, stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.tree_attention import pack_beams
from redrafter_mlx.tree_budget import TreeBudget
from redrafter_mlx.verification import (
    SamplingParams,
    accept,
    draw_target,
    host_draw,
    host_nucleus,
    node_targets,
    nucleus,
    sample_rows,
    sampling_logits,
    walk_targets,
)

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_top_p
from scipy.stats import chisquare
from tiny_models import tiny_drafter, tiny_llm

V = 5
PROMPT = [1, 3, 2]
N_TOKENS = 3
RUNS = 2500
SEEDS = range(10_000, 10_000 + RUNS)  # a fixed seed set: the test is deterministic


def np_processed_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """mlx-lm's sampling law, in NumPy: top-p, min-p, top-k on log-probs, then temperature."""
    logits = logits.astype(np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    keep = np.ones_like(logprobs, dtype=bool)
    probs = np.exp(logprobs)
    if 0 < p.top_p < 1:
        order = np.argsort(probs)  # ascending
        mass_above = np.cumsum(probs[order][::-1])[::-1] - probs[order]
        keep[order[mass_above >= p.top_p]] = False
    if p.min_p:
        keep &= logprobs >= logprobs.max() + np.log(p.min_p)
    if p.top_k:
        keep[np.argsort(-logprobs)[p.top_k :]] = False
    z = np.where(keep, logprobs / p.temp, -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


def exact_law(model, params: SamplingParams) -> dict[tuple, float]:
    law = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        prob = 1.0
        for k in range(N_TOKENS):
            logits = np.array(model(mx.array(PROMPT + list(seq[:k]))[None])[0, -1])
            prob *= np_processed_probs(logits, params)[seq[k]]
            if prob == 0:
                break
        law[seq] = prob
    return law


def chi_square_p(counts: Counter, law: dict[tuple, float], runs: int) -> float:
    """Pool the rare outcomes (expected < 5) into one bin, then a chi-square goodness of fit."""
    assert not set(counts) - {s for s, p in law.items() if p > 0}, "impossible sequence drawn"
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for seq, p in law.items():
        if p * runs >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(p * runs)
        else:
            pool_o += counts.get(seq, 0)
            pool_e += p * runs
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (runs / np.sum(exp))
    assert len(obs) >= 10, "too few bins for a meaningful test"
    return float(chisquare(obs, exp).pvalue)


CONFIGS = {
    "T=1.0": SamplingParams(temp=1.0),
    "T=0.7,top_p=0.8": SamplingParams(temp=0.7, top_p=0.8),
}


@pytest.fixture(scope="module")
def setup():
    model = tiny_llm("llama", vocab_size=V, seed=3, scale=1.0)
    llm = TreeLLM(model)
    propose = make_proposer(tiny_drafter(32, V, seed=4), llm.embed, 3, 3)
    return model, llm, propose


def test_processed_probs_match_mlx_lm_filters():
    """The NumPy law above is the one mlx-lm's sampler functions produce."""
    logits = mx.array(np.random.default_rng(0).normal(size=(4, 9)) * 2, dtype=mx.float32)
    for params in [
        SamplingParams(temp=0.7, top_p=0.8),
        SamplingParams(temp=1.3, min_p=0.2),
        SamplingParams(temp=0.5, top_k=3),
        SamplingParams(temp=1.0),
    ]:
        got = np.array(mx.softmax(sampling_logits(logits, params), axis=-1))
        want = np.stack([np_processed_probs(np.array(row), params) for row in logits])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name,variant",
    [(name, "") for name in CONFIGS]
    + [("T=0.7,top_p=0.8", "pruned"), ("T=1.0", "lookup"), ("T=0.7,top_p=0.8", "lookup+pruned")]
    + [("T=1.0", "lookup+solo")],
)
def test_redrafter_sampling_matches_exact_law(setup, name, variant):
    """Also with the tree pruned to a budget: which nodes get verified depends on the drafter
    only, so the emitted tokens keep the LLM's law. And with prompt lookup (1-grams, which hit
    often here): its drafts depend on the tokens emitted before, never on this step's draws;
    with one beam ("solo"), a lookup match replaces it and the drafter runs on the other steps."""
    model, llm, propose = setup
    kw = {}
    if "solo" in variant:
        propose = make_proposer(tiny_drafter(32, V, seed=4), llm.embed, 1, 3)
    if "pruned" in variant:
        propose = make_proposer(tiny_drafter(32, V, seed=4), llm.embed, 3, 3, with_scores=True)
        kw["budget"] = TreeBudget([1.0, 1.05, 1.1, 1.15])  # at most 4 of 7 nodes
    if "lookup" in variant:
        kw["lookup"] = 1
    params = CONFIGS[name]
    law = exact_law(model, params)
    counts: Counter = Counter()
    accepted = looked_up = accepted_lookup = 0
    for seed in SEEDS:
        mx.random.seed(seed)
        outs = list(
            stream_redrafter(llm, propose, PROMPT, max_tokens=N_TOKENS, sampling=params, **kw)
        )
        if "pruned" in variant:
            assert all(o.stats.tree_size <= 4 for o in outs)
        counts[tuple(t for o in outs for t in o.tokens)] += 1
        accepted += sum(o.stats.accepted for o in outs)
        looked_up += sum(o.stats.looked_up for o in outs)
        accepted_lookup += sum(o.stats.accepted for o in outs if o.stats.looked_up)
    assert accepted > RUNS // 4, "drafts were rarely accepted: the test would not exercise them"
    if "lookup" in variant:
        assert looked_up > RUNS // 4 and accepted_lookup > RUNS // 10, (looked_up, accepted_lookup)
    p = chi_square_p(counts, law, RUNS)
    assert p > 1e-3, f"ReDrafter samples do not follow the LLM's law (p={p:.2e})"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mlx_lm_sampling_matches_exact_law(setup, name):
    """The same check on mlx-lm's own sampler validates the enumerated law itself."""
    model, _, _ = setup
    params = CONFIGS[name]
    law = exact_law(model, params)
    counts: Counter = Counter()
    for seed in SEEDS:
        mx.random.seed(seed)
        outs = stream_autoregressive(model, PROMPT, max_tokens=N_TOKENS, sampling=params)
        counts[tuple(t for o in outs for t in o.tokens)] += 1
    p = chi_square_p(counts, law, RUNS)
    assert p > 1e-3, f"mlx-lm samples do not follow the enumerated law (p={p:.2e})"


def test_walk_targets_draw_only_along_the_walk():
    """Visited nodes get the draw node_targets would give (top_k=1 makes it deterministic);
    the others get -1, and acceptance reads the same path as with targets at every node."""
    tree = pack_beams(np.array([[5, 1, 2], [5, 1, 3], [5, 4, 0]]))  # 6 packed nodes
    kids = tree.children()
    assert kids[0] == {1: 1, 4: 4} and kids[1] == {2: 2, 3: 3}
    logits = np.random.default_rng(0).normal(size=(tree.size, 6)).astype(np.float32)
    logits[0, 1] = logits[1, 3] = 9.0  # the walk: root -> 1 -> 3, then stops
    params = SamplingParams(temp=1.0, top_k=1)
    got = walk_targets(mx.array(logits), kids, params).tolist()
    top = logits.argmax(-1)
    assert got == [1, 3, -1, int(top[3]), -1, -1]
    every = node_targets(mx.array(logits), params)
    assert np.array_equal(np.array(every)[[0, 1, 3]], top[[0, 1, 3]])
    beams, unpacker = mx.array(np.array([[5, 1, 2], [5, 1, 3], [5, 4, 0]])), mx.array(tree.unpacker)
    a, b = accept(beams, unpacker, mx.array(got)), accept(beams, unpacker, every)
    assert (a.count.item(), a.beam.item(), a.tokens.tolist()) == (
        b.count.item(),
        b.beam.item(),
        b.tokens.tolist(),
    )


def test_walk_targets_draw_on_the_host_with_a_generator():
    """With a NumPy generator and temperature/top-p the visited rows are drawn in NumPy: a tiny
    temperature makes every draw the row's argmax, so the walk is the one above."""
    tree = pack_beams(np.array([[5, 1, 2], [5, 1, 3], [5, 4, 0]]))
    logits = np.random.default_rng(0).normal(size=(tree.size, 6)).astype(np.float32)
    logits[0, 1] = logits[1, 3] = 9.0
    params = SamplingParams(temp=1e-3, top_p=0.9)
    assert params.host_drawable
    got = walk_targets(mx.array(logits), tree.children(), params, np.random.default_rng(1))
    assert got.tolist() == [1, 3, -1, int(logits[3].argmax()), -1, -1]
    with pytest.raises(ValueError, match="temperature and top-p only"):
        host_draw(logits[0], SamplingParams(temp=1.0, top_k=2), np.random.default_rng(0))


def test_rows_rounding_decides_are_drawn_by_mlx():
    """mlx-lm's float32 log-probabilities tie the last token with the seven zeros, so its top-p
    set holds all eight; host_nucleus leaves the row to sample_rows, which draws token 7 too."""
    tied = mx.array([[0.0] * 7 + [-1e-7]], dtype=mx.float32)
    params = SamplingParams(temp=1.0, top_p=0.37)
    assert host_nucleus(np.asarray(tied)[0], params.top_p) is None
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    draws = {draw_target(tied, 0, params, rng) for _ in range(400)}
    assert draws == set(range(8))


# top-p values no cumulative share of these small rows lands on (a tie there is decided by
# float rounding, differently by any two summation orders)
TOP_PS = [0.37, 0.618, 0.83, 0.911, 0.953, 0.987]


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4).flatmap(
        lambda n: st.integers(1, 48).flatmap(
            lambda v: st.lists(
                st.lists(
                    st.sampled_from([-9.0, -2.0, 0.0, 0.5, 1.0, 3.0, 7.5]), min_size=v, max_size=v
                )
                | st.lists(st.floats(-8, 8, width=32), min_size=v, max_size=v),
                min_size=n,
                max_size=n,
            )
        )
    ),
    top_p=st.sampled_from(TOP_PS),
    candidates=st.integers(1, 64),
)
def test_nucleus_is_mlx_lms_top_p_set_where_it_says_exact(rows, top_p, candidates):
    """Ties included: a row marked exact keeps exactly the tokens apply_top_p keeps."""
    logits = mx.array(np.array(rows, dtype=np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids, vals, keep, exact = nucleus(logprobs, top_p, candidates)
    want = np.array(apply_top_p(logprobs, top_p)) > -np.inf
    ids, vals, keep = np.array(ids), np.array(vals), np.array(keep)
    assert np.all(np.diff(vals, axis=-1) <= 0)  # likeliest first
    for r, ok in enumerate(np.array(exact)):
        if candidates >= logits.shape[-1]:
            assert ok  # every token is a candidate
        if ok:
            assert sorted(ids[r][keep[r]].tolist()) == np.flatnonzero(want[r]).tolist()


@settings(max_examples=300, deadline=None)
@given(
    row=st.integers(1, 48).flatmap(
        lambda v: (
            st.lists(
                st.sampled_from([-40.0, -25.0, -9.0, -2.0, 0.0, 0.5, 1.0, 3.0, 7.5]),
                min_size=v,
                max_size=v,
            )
            | st.lists(st.floats(-30, 8, width=32), min_size=v, max_size=v)
        )
    ),
    top_p=st.sampled_from(TOP_PS),
)
# float32 exp(logit - max) rounds 0 and 1.2e-7 to one value; mlx-lm's log-probabilities do not
@example(row=[0.0] * 16 + [1.0, 1.0, 2.0, 2.5, 1.1920928955078125e-07], top_p=0.618)
def test_host_nucleus_is_mlx_lms_top_p_set(row, top_p):
    """Ties included, and rows whose nucleus reaches below the first candidate floors. Rows
    that float32 rounding decides are left to sample_rows (None)."""
    logits = np.array(row, dtype=np.float32)
    logprobs = mx.array(logits[None]) - mx.logsumexp(mx.array(logits[None]), axis=-1, keepdims=True)
    want = np.flatnonzero(np.array(apply_top_p(logprobs, top_p))[0] > -np.inf).tolist()
    got = host_nucleus(logits, top_p)
    if got is not None:
        assert sorted(got.tolist()) == want


def test_host_nucleus_decides_real_looking_rows():
    """LLM-like rows (a few likely tokens over a 152k tail that the nucleus does not reach):
    decided, and equal to mlx-lm's; a token within rounding of the edge is left to MLX."""
    rng = np.random.default_rng(3)
    for top_p in TOP_PS[:-1]:
        row = rng.normal(size=151_936).astype(np.float32) * 2 - 8
        row[rng.choice(151_936, 6, replace=False)] += rng.uniform(12, 18, 6).astype(np.float32)
        got = host_nucleus(row, top_p)
        lp = mx.array(row[None]) - mx.logsumexp(mx.array(row[None]), axis=-1, keepdims=True)
        want = np.flatnonzero(np.array(apply_top_p(lp, top_p))[0] > -np.inf).tolist()
        assert got is not None and sorted(got.tolist()) == want
    tied = np.array([0.0] * 7 + [-1e-7], dtype=np.float32)  # mlx-lm's float32 ties all eight
    assert host_nucleus(tied, 0.37) is None


@pytest.mark.parametrize("shape", ["peaked", "flat", "no top-p"])
def test_host_draw_follows_mlx_lms_law(shape):
    rng = np.random.default_rng(1)
    row = rng.normal(size=40).astype(np.float32) * 3
    if shape == "peaked":
        row[[3, 17, 29]] += [12.0, 11.5, 11.0]
    params = SamplingParams(temp=0.7, top_p=0.0 if shape == "no top-p" else 0.9)
    n, draws_rng = 20_000, np.random.default_rng(2)
    draws = np.array([host_draw(row, params, draws_rng) for _ in range(n)])
    law = np_processed_probs(row, params)
    assert not set(draws.tolist()) - set(np.flatnonzero(law > 0).tolist())
    seen = law * n >= 5
    obs, exp = np.bincount(draws, minlength=40), law * n
    obs = np.append(obs[seen], obs[~seen].sum())
    exp = np.append(exp[seen], exp[~seen].sum())
    keep = exp > 0
    p = chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue
    assert p > 1e-3, p


@pytest.mark.parametrize("top_p,kept", [(0.5, [0]), (0.75, [0, 1]), (0.875, [0, 1, 2])])
def test_nucleus_drops_the_token_whose_mass_above_is_exactly_top_p(top_p, kept):
    """Dyadic probabilities make the boundary exact in float32: a token whose likelier tokens
    hold exactly top_p of the mass is dropped, as apply_top_p drops it (``<``, not ``<=``)."""
    p = np.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]], dtype=np.float32)
    logprobs = mx.array(np.log(p))
    want = np.flatnonzero(np.array(apply_top_p(logprobs, top_p))[0] > -np.inf).tolist()
    ids, _, keep, exact = nucleus(logprobs, top_p, 4)
    assert want == kept
    assert bool(exact.item())
    assert sorted(np.array(ids)[0][np.array(keep)[0]].tolist()) == kept


def test_nucleus_decides_peaked_rows_and_defers_flat_ones():
    rng = np.random.default_rng(0)
    peaked = rng.normal(size=(1, 5000)).astype(np.float32)
    peaked[0, :3] += 30  # three tokens hold nearly all the mass
    flat = rng.normal(size=(1, 5000)).astype(np.float32)
    logits = mx.array(np.concatenate([peaked, flat]))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids, _, keep, exact = nucleus(logprobs, 0.95, 64)
    assert np.array(exact).tolist() == [True, False]
    assert set(np.array(ids)[0][np.array(keep)[0]].tolist()) <= {0, 1, 2}


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_sample_rows_follows_mlx_lms_law(shape):
    """The nucleus fast path (peaked: decided among 8 candidates) and its fallback (flat: the
    nucleus is wider than 8) both draw from mlx-lm's processed distribution."""
    rng = np.random.default_rng(1)
    row = rng.normal(size=40).astype(np.float32)
    if shape == "peaked":
        row[[3, 17, 29]] += [6.0, 5.5, 5.0]
    params = SamplingParams(temp=0.7, top_p=0.9)
    lp = mx.array(row[None]) - mx.logsumexp(mx.array(row[None]), axis=-1, keepdims=True)
    assert bool(nucleus(lp, params.top_p, 8)[3].item()) == (shape == "peaked")
    mx.random.seed(7)
    n = 20_000
    draws = np.array(sample_rows(mx.array(np.tile(row, (n, 1))), params, candidates=8))
    law = np_processed_probs(row, params)
    assert not set(draws.tolist()) - set(np.flatnonzero(law > 0).tolist())
    seen = law * n >= 5
    obs = np.bincount(draws, minlength=40)
    exp = law * n
    obs = np.append(obs[seen], obs[~seen].sum())
    exp = np.append(exp[seen], exp[~seen].sum())
    keep = exp > 0
    p = chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue
    assert p > 1e-3, p
