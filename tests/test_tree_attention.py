"""Packing beams into a prefix tree: properties, masks, and exact logits over the tree."""

from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.tree_attention import attend, pack_beams, unpack

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import beam_arrays
from tiny_models import FAMILIES, tiny_llm


def test_issue_example():
    beams = np.array([[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]])
    tree = pack_beams(beams)
    assert tree.tokens.tolist() == [91, 92, 93, 95, 94, 96, 97]
    assert tree.depths.tolist() == [0, 1, 2, 3, 2, 3, 3]
    assert tree.unpacker.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 2, 6]]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 1, 4, 2]


@settings(max_examples=300, deadline=None)
@given(beam_arrays())
def test_pack_unpack_round_trip(beams):
    tree = pack_beams(beams)
    W, L = beams.shape
    assert np.array_equal(unpack(tree, tree.tokens), beams)
    assert np.array_equal(unpack(tree, tree.depths), np.broadcast_to(np.arange(L), (W, L)))
    assert tree.size <= 1 + W * (L - 1)
    # Every distinct prefix appears exactly once.
    prefixes = {tuple(beams[b, : d + 1]) for b in range(W) for d in range(L)}
    assert tree.size == len(prefixes)
    # Owned by the lowest beam index, packed beam by beam: first use order is increasing.
    first_use = unpack(tree, np.arange(tree.size)).reshape(-1)
    seen = []
    for i in first_use:
        if i not in seen:
            seen.append(i)
    assert seen == list(range(tree.size))
    # Parents precede children and sit one level up.
    for i in range(1, tree.size):
        p = tree.parents[i]
        assert 0 <= p < i and tree.depths[p] == tree.depths[i] - 1
    assert tree.parents[0] == -1 and tree.depths[0] == 0


@settings(max_examples=300, deadline=None)
@given(beam_arrays(), st.integers(0, 7))
def test_mask_equals_brute_force_ancestors(beams, past):
    tree = pack_beams(beams)
    W, L = beams.shape
    n = tree.size
    expected = np.zeros((n, past + n), dtype=bool)
    expected[:, :past] = True
    for b in range(W):
        for d in range(L):
            i = tree.unpacker[b, d]
            for d2 in range(d + 1):  # every token on the beam up to d is an ancestor-or-self
                expected[i, past + tree.unpacker[b, d2]] = True
    assert np.array_equal(tree.attention_mask(past), expected)
    assert np.array_equal(tree.positions(past), past + tree.depths)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="same guaranteed token"):
        pack_beams(np.array([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="shape"):
        pack_beams(np.array([1, 2, 3]))


@pytest.mark.parametrize("family", [*FAMILIES, "llama_swa"])
def test_tree_logits_equal_sequential_logits(family):
    """Verify-logits over the packed tree == per-beam sequential forward logits."""
    model = tiny_llm(family, window=6)
    llm = TreeLLM(model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 64, size=11).tolist()  # longer than the window: 6
    beams = np.concatenate(
        [np.full((5, 1), 7), rng.integers(0, 3, size=(5, 4))], axis=1
    )  # heavy sharing
    tree = pack_beams(beams)
    assert tree.size < beams.size

    cache = llm.make_cache()
    llm.hidden_states(mx.array(prompt), cache, positions=0)
    past = len(prompt)
    hidden = llm.hidden_states(
        mx.array(tree.tokens),
        cache,
        positions=mx.array(tree.positions(past)),
        ancestors=mx.array(tree.ancestor_mask()),
    )
    tree_logits = np.array(llm.logits(hidden))
    for b in range(beams.shape[0]):
        seq = mx.array(prompt + beams[b].tolist())[None]
        ref = np.array(model(seq)[0, past:])  # plain mlx-lm forward, no cache
        got = tree_logits[tree.unpacker[b]]
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    n=st.integers(1, 9),
    past=st.integers(0, 20),
    kind=st.sampled_from(["bool", "causal", "additive", "none"]),
    seed=st.integers(0, 2**16),
)
def test_attend_equals_mlx_attention(kv_heads, group, n, past, kind, seed):
    """The folded attention of a tree forward == mx.fast.scaled_dot_product_attention."""
    rng = np.random.default_rng(seed)
    S = past + n
    q = mx.array(rng.standard_normal((1, kv_heads * group, n, 16), dtype=np.float32))
    k, v = (mx.array(rng.standard_normal((1, kv_heads, S, 16), dtype=np.float32)) for _ in "kv")
    mask = None
    if kind == "bool":  # a random tree over the new tokens: each sees itself and its past
        tree = np.tril(rng.random((n, n)) < 0.5) | np.eye(n, dtype=bool)
        mask = mx.array(np.concatenate([np.ones((n, past), bool), tree], 1))
    elif kind == "additive":
        mask = mx.array(rng.standard_normal((n, S), dtype=np.float32))
    elif kind == "causal":
        mask = "causal"
    got = attend(q, k, v, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_tree_forwards_use_the_folded_attention(monkeypatch):
    """Routed only inside our forwards of 2..64 tokens; plain mlx-lm calls are untouched."""
    import redrafter_mlx.llm as llm_module

    calls = []
    real = llm_module.attend
    monkeypatch.setattr(llm_module, "attend", lambda *a: calls.append(a[0].shape) or real(*a))
    model = tiny_llm("llama")
    llm = TreeLLM(model)
    cache = llm.make_cache()
    llm.hidden_states(mx.arange(5), cache, positions=0)  # a 5-token chain (prompt)
    assert len(calls) == len(cache)
    calls.clear()
    model(mx.arange(5)[None])  # mlx-lm's own forward, no tree cache
    llm.hidden_states(mx.arange(1), cache, positions=5)  # one token: mlx-lm's vector path
    assert calls == []
