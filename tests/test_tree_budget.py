"""Pruning the drafted tree to the nodes worth their verification cost."""

import functools
import itertools

from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.generate import stream_autoregressive, stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.oracle import OracleProposer
from redrafter_mlx.tree_attention import NO_TOKEN, pack_beams
from redrafter_mlx.tree_budget import (
    TreeBudget,
    fit_alpha,
    measure_step_cost,
    prune,
    select_nodes,
)
from redrafter_mlx.verification import accept

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import beam_arrays
from tiny_models import tiny_drafter, tiny_llm

VOCAB = 64


@st.composite
def scored_trees(draw, max_nodes=None):
    """Beams, their packed tree, per-beam prefix log-probs that agree on shared prefixes (as
    the drafter's do), and an increasing step cost per tree size."""
    beams = draw(beam_arrays())
    tree = pack_beams(beams)
    if max_nodes is not None:
        assume(tree.size <= max_nodes)
    step = draw(st.lists(st.floats(-8.0, 0.0), min_size=tree.size, max_size=tree.size))
    node_logp = np.zeros(tree.size)
    for i in range(1, tree.size):  # path log-prob: the parent's plus the node's own step
        node_logp[i] = node_logp[tree.parents[i]] + step[i]
    prefix_scores = node_logp[tree.unpacker]
    increments = draw(st.lists(st.floats(0.0, 2.0), min_size=1, max_size=tree.size + 2))
    cost = list(1.0 + np.cumsum([0.0] + increments[1:]))
    return beams, tree, prefix_scores, node_logp, cost


def ancestor_closed(keep: np.ndarray, parents: np.ndarray) -> bool:
    kept = set(keep.tolist())
    return 0 in kept and all(int(parents[i]) in kept for i in kept if i != 0)


@settings(max_examples=300, deadline=None)
@given(scored_trees(max_nodes=11))
def test_selection_is_the_best_subtree(case):
    """Against brute force over every subtree that keeps the root and each kept node's parent:
    no other subtree has more expected tokens per unit of cost."""
    _, tree, _, node_logp, cost = case
    keep = select_nodes(node_logp, tree.parents, cost)
    assert keep[0] == 0 and np.all(np.diff(keep) > 0) and keep.size <= len(cost)
    assert ancestor_closed(keep, tree.parents)

    def value(nodes) -> float:
        return (1.0 + np.exp(node_logp[list(nodes)]).sum()) / cost[len(nodes)]

    best = 0.0
    others = range(1, tree.size)
    for r in range(0, min(len(cost), tree.size)):
        for nodes in itertools.combinations(others, r):
            if ancestor_closed(np.array((0, *nodes)), tree.parents):
                best = max(best, value(nodes))
    assert value(keep[1:]) == pytest.approx(best, rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(scored_trees(), st.data())
def test_pruned_tree_and_beams_verify_only_what_was_kept(case, data):
    beams, tree, prefix_scores, node_logp, cost = case
    np.testing.assert_allclose(tree.node_values(prefix_scores), node_logp)
    sub, pruned, keep = prune(tree, beams, node_logp, cost)
    np.testing.assert_array_equal(keep, select_nodes(node_logp, tree.parents, cost))
    assert sub.size == keep.size
    np.testing.assert_array_equal(sub.tokens, tree.tokens[keep])
    np.testing.assert_array_equal(sub.depths, tree.depths[keep])
    np.testing.assert_array_equal(sub.ancestor_mask(), tree.ancestor_mask()[np.ix_(keep, keep)])
    kept = np.isin(tree.unpacker, keep)
    np.testing.assert_array_equal(pruned, np.where(kept, beams, NO_TOKEN))
    assert np.all(kept[:, :-1] >= kept[:, 1:])  # what survives of a beam is a prefix of it
    np.testing.assert_array_equal(keep[sub.unpacker][kept], tree.unpacker[kept])

    # Acceptance over the pruned tree = the longest path of kept nodes that the targets
    # accept, whatever the targets (-1: a node the sampling walk did not visit).
    alphabet = int(beams.max()) + 1
    targets = np.array(
        data.draw(st.lists(st.integers(-1, alphabet), min_size=sub.size, max_size=sub.size)),
        dtype=np.int32,
    )
    acc = accept(mx.array(pruned), mx.array(sub.unpacker), mx.array(targets))
    longest = 0
    for i in range(1, sub.size):
        node, ok = i, True
        while node != 0:
            ok &= targets[sub.parents[node]] == sub.tokens[node]
            node = sub.parents[node]
        longest = max(longest, int(sub.depths[i])) if ok else longest
    assert int(acc.count.item()) == longest + 1


def test_flat_cost_keeps_every_possible_node_and_steep_cost_only_the_root():
    beams = np.array([[7, 1, 2], [7, 1, 3], [7, 4, 5]])
    tree = pack_beams(beams)  # 7 -> 1 -> {2, 3}; 7 -> 4 -> 5
    prefix = np.log(np.array([[1, 0.6, 0.3], [1, 0.6, 0.2], [1, 0.3, 0.1]]))
    node_logp = tree.node_values(prefix)
    assert select_nodes(node_logp, tree.parents, [1.0] * 9).tolist() == list(range(6))
    assert select_nodes(node_logp, tree.parents, [1.0, 5.0, 9.0]).tolist() == [0]
    # A cost cliff after three tokens: the two likeliest nodes, 1 (0.6) and then 4 and 2
    # (both 0.3: the earlier packed, 2, wins the tie).
    assert select_nodes(node_logp, tree.parents, [1.0, 1.1, 1.2, 2.2]).tolist() == [0, 1, 2]
    # A node the drafter gives no chance (a duplicate beam's LOG_0 score) is never verified.
    prefix[2] = [0.0, -50000.0, -50001.0]
    keep = select_nodes(tree.node_values(prefix), tree.parents, [1.0] * 9)
    assert keep.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="step_cost is empty"):
        select_nodes(node_logp, tree.parents, [])


@functools.cache
def model_for(family: str):
    model = tiny_llm(family, vocab_size=VOCAB, seed=1, window=6)
    return model, TreeLLM(model)


COSTS = {  # seconds per step verifying 1, 2, ... tokens
    "flat": [1.0] * 40,
    "cliff": [1.0, 1.05, 1.1, 2.2, 2.3, 2.4, 3.5],
    "steep": [1.0, 4.0, 9.0],
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "llama_swa"])
@pytest.mark.parametrize("cost", list(COSTS))
def test_pruned_greedy_equals_mlx_lm(family, cost):
    model, llm = model_for(family)
    prompt, n = [5, 9, 2, 33, 7], 30
    ref = [t for o in stream_autoregressive(model, prompt, max_tokens=n) for t in o.tokens]
    sizes = []
    for seed, (W, L) in enumerate([(1, 4), (3, 3), (4, 5)]):
        drafter = tiny_drafter(32, VOCAB, seed=seed)
        propose = make_proposer(drafter, llm.embed, W, L, with_scores=True)
        outs = list(
            stream_redrafter(
                llm,
                propose,
                prompt,
                max_tokens=n,
                budget=TreeBudget(COSTS[cost]),
                cache=llm.make_cache(window_slack=1),
            )
        )
        assert [t for o in outs for t in o.tokens] == ref, (W, L)
        sizes += [o.stats.tree_size for o in outs[1:]]
        assert max(sizes) <= len(COSTS[cost])
    if cost == "steep":
        assert set(sizes) == {1}
    else:  # the pruning picks sizes per step, not one size for all
        assert len(set(sizes)) > 1


def test_pruning_needs_scored_beams():
    model, llm = model_for("llama")
    oracle = OracleProposer(llm, [1, 2], [3, 4, 5, 6], 2, 3, VOCAB)
    with pytest.raises(ValueError, match="with_scores=True"):
        next(stream_redrafter(llm, oracle, [1, 2], budget=TreeBudget([1.0, 1.1])))
    with pytest.raises(ValueError, match="positive seconds"):
        TreeBudget([])


def test_measure_step_cost():
    _, llm = model_for("qwen2")
    propose = make_proposer(tiny_drafter(32, VOCAB), llm.embed, 2, 3, with_scores=True)
    cost = measure_step_cost(llm, propose, 5, past=12, repeats=2)
    assert len(cost) == 5 and all(c > 0 for c in cost)
    with pytest.raises(ValueError, match="max_size >= 1"):
        measure_step_cost(llm, propose, 0)


def test_fit_alpha_recovers_the_calibration_exponent():
    rng = np.random.default_rng(0)
    logp = np.log(rng.uniform(0.02, 1.0, size=4000))
    for alpha in (0.7, 1.0, 1.5, 2.5):
        accepted = rng.random(4000) < np.exp(alpha * logp)
        assert fit_alpha(logp, accepted) == pytest.approx(alpha, rel=0.1)


def test_budget_learns_that_an_overconfident_drafter_is_overconfident():
    """A chain the drafter rates 0.8 per token, accepted 0.8**2 of the time: observing the
    outcomes moves alpha from 1 to about 2, and the budget then verifies shorter chains."""
    rng = np.random.default_rng(1)
    beams = np.array([[5, 6, 7, 8]])
    prefix = np.log(0.8) * np.arange(4.0)[None, :]
    # The 4th token is worth its cost (+17%) at alpha = 1 (+0.51 tokens), not at 2 (+0.26).
    budget = TreeBudget([1.0, 1.0, 1.0, 1.17])
    tree, _ = budget.prune(pack_beams(beams), beams, prefix)
    assert budget.alpha == 1.0 and tree.size == 4
    for _ in range(200):
        tree, _ = budget.prune(pack_beams(beams), beams, prefix)
        depth = 0
        while depth < tree.size - 1 and rng.random() < 0.8**2:
            depth += 1
        budget.observe(list(range(depth + 1)))
    assert budget.alpha == pytest.approx(2.0, rel=0.15)
    assert budget.prune(pack_beams(beams), beams, prefix)[0].size == 3
