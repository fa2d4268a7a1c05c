"""Which drafted nodes are worth verifying: expected tokens per second of step time.

A verification forward over n tree tokens costs neither one token's time nor n times it, and
the curve is machine-specific and not smooth. With MKL on a 2-core Xeon a 3-token forward
costs 1.22x one token and a 4-token one 2.2x (MKL's kernels for four or more rows re-read the
weights); on a GPU it stays nearly flat up to a dozen tokens. So instead of verifying every
packed node, each step verifies the part of the tree that pays the most for its cost:

- the drafter's probability of a node's path, ``p = exp(prefix log-prob)``, ranks the nodes by
  their chance of being accepted (the drafter is distilled to predict the LLM's tokens). A node
  is accepted only with all its ancestors, so these chances are nested. The drafter is
  overconfident away from its training data (on HumanEval, the shipped Qwen drafter's nodes
  with p = 0.45 were accepted 28% of the time), so the chance is taken as ``p ** alpha``, with
  ``alpha`` fitted by maximum likelihood to the nodes verified so far (:class:`TreeBudget`);
- verifying the node set S yields ``1 + sum of p(u) ** alpha over u in S`` tokens in
  expectation: the sure token, plus each drafted node's chance of lying on the accepted path;
- the best S of size n - 1 is the n - 1 likeliest nodes (an ancestor-closed set, since no
  node is likelier than its parent), and n maximises expected tokens / ``step_cost[n - 1]``,
  the measured seconds of a step verifying n tokens (:func:`measure_step_cost`).

Pruning never changes what is generated: the verification of any subtree is exact (see
:mod:`redrafter_mlx.verification`), and the subtree is chosen from the drafter's scores and
past steps' outcomes, before the LLM sees this step's tree.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from .beam_search import Proposer
from .greedy_head import GreedyHead
from .llm import TreeLLM
from .tree_attention import NO_TOKEN, PackedTree


def select_nodes(
    node_logp: np.ndarray, parents: np.ndarray, step_cost: Sequence[float]
) -> np.ndarray:
    """Packed indices worth verifying, ascending, root first.

    node_logp: [n] the drafter's log-probability of each node's path (root: ignored);
    parents: [n] packed parent indices (parents precede children); step_cost: seconds of a
    step verifying 1, 2, ... tokens (its length caps the tree size).
    """
    n = node_logp.shape[0]
    if not step_cost:
        raise ValueError("step_cost is empty: give the cost of a step for sizes 1, 2, ...")
    logp = np.asarray(node_logp, dtype=np.float64).copy()
    logp[0] = 0.0
    for i in range(1, n):  # guard against rounding: never likelier than the parent
        logp[i] = min(logp[i], logp[parents[i]])
    # Likeliest first; ties keep packed order, so every parent comes before its children.
    order = 1 + np.lexsort((np.arange(n - 1), -logp[1:]))
    sizes = min(len(step_cost), n)
    expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.exp(logp[order]))])[:sizes]
    best = int(np.argmax(expected / np.asarray(step_cost[:sizes], dtype=np.float64))) + 1
    return np.sort(np.concatenate([[0], order[: best - 1]]))


def prune(
    tree: PackedTree, beams: np.ndarray, node_logp: np.ndarray, step_cost: Sequence[float]
) -> tuple[PackedTree, np.ndarray, np.ndarray]:
    """The subtree worth verifying, the beams [W, L] to accept against (every dropped drafted
    token is ``NO_TOKEN``, so no beam is accepted past what was verified) and the kept nodes'
    indices in ``tree``."""
    keep = select_nodes(node_logp, tree.parents, step_cost)
    if keep.size == tree.size:
        return tree, beams, keep
    sub, kept = tree.subtree(keep)
    return sub, np.where(kept, beams, NO_TOKEN).astype(np.int32), keep


#: Candidate calibration exponents, and how many verified nodes to see before fitting one.
ALPHAS = np.geomspace(0.5, 4.0, 31)
MIN_OBSERVATIONS = 32


def fit_alpha(logp: np.ndarray, accepted: np.ndarray) -> float:
    """The ``alpha`` in ALPHAS under which ``P(accepted) = exp(alpha * logp)`` makes the
    observations likeliest. logp: [N] path log-probs (< 0); accepted: [N] bool."""
    q = np.exp(np.minimum(ALPHAS[:, None] * logp[None, :], -1e-6))  # [A, N], below 1
    loglik = np.where(accepted[None, :], np.log(q), np.log1p(-q)).sum(axis=1)
    return float(ALPHAS[int(np.argmax(loglik))])


class TreeBudget:
    """For a generation or a chat session: the measured step cost, and the calibration
    fitted as it goes.

    ``prune`` picks the nodes to verify; ``observe`` records which verified nodes the LLM
    accepted and refits ``alpha`` on the last ``window`` of them. The choice depends only on
    the drafter's scores and past outcomes, never on the current step's LLM output, so the
    generated tokens are unchanged.
    """

    def __init__(
        self,
        step_cost: Sequence[float],
        window: int = 1024,
        refit_every: int = 8,
        alpha: float = 1.0,  # the calibration to start from (an earlier run's fit)
    ):
        if not step_cost or min(step_cost) <= 0:
            raise ValueError(f"step_cost must list positive seconds per size, got {step_cost}")
        self.step_cost = list(step_cost)
        self.alpha = alpha
        self._seen: deque[tuple[float, bool]] = deque(maxlen=window)
        self._steps, self._refit_every = 0, refit_every
        self._verified = np.zeros(1)  # path log-prob of each node of the verified tree

    def prune(
        self, tree: PackedTree, beams: np.ndarray, prefix_scores: np.ndarray
    ) -> tuple[PackedTree, np.ndarray]:
        """The subtree to verify and the beams to accept against (see :func:`prune`)."""
        node_logp = tree.node_values(prefix_scores).astype(np.float64)
        tree, beams, keep = prune(tree, beams, self.alpha * node_logp, self.step_cost)
        self._verified = node_logp[keep]
        return tree, beams

    def observe(self, path: Sequence[int]) -> None:
        """The verified tree's accepted path (packed indices, root first): its drafted nodes
        were accepted, every other verified drafted node was not."""
        accepted = np.zeros(self._verified.size, dtype=bool)
        accepted[list(path)] = True
        self._seen.extend(zip(self._verified[1:].tolist(), accepted[1:].tolist(), strict=True))
        self._steps += 1
        if self._steps % self._refit_every == 0 and len(self._seen) >= MIN_OBSERVATIONS:
            logp, ok = np.array(self._seen).T
            self.alpha = fit_alpha(logp, ok.astype(bool))


def measure_step_cost(
    llm: TreeLLM,
    propose: Proposer,
    max_size: int,
    *,
    past: int = 128,
    repeats: int = 3,
    head: GreedyHead | None = None,
) -> list[float]:
    """Median seconds of a greedy step verifying n = 1..max_size tokens on this machine: the
    proposer's beam search, then the LLM forward over n tree tokens and their argmax (from
    ``head``'s screen where it is given and can decide, as the engine takes it).

    Uses its own cache holding ``past`` tokens; sizes are interleaved within each repeat so
    that drift in the machine's speed spreads over all of them. One warm-up round.
    """
    if max_size < 1 or repeats < 1:
        raise ValueError(f"need max_size >= 1 and repeats >= 1, got {max_size}, {repeats}")
    cache = llm.make_cache()
    hidden = llm.hidden_states(mx.zeros((past,), dtype=mx.int32), cache, positions=0)[-1]
    g0 = mx.array(0, dtype=mx.int32)
    mx.eval(hidden, [c.state for c in cache])
    times: dict[int, list[float]] = {n: [] for n in range(1, max_size + 1)}
    for r in range(repeats + 1):
        for n in times:
            tic = time.perf_counter()
            draft = propose(hidden, g0)
            out = llm.hidden_states(
                mx.zeros((n,), dtype=mx.int32),
                cache,
                positions=mx.arange(past, past + n, dtype=mx.int32),
                ancestors=mx.tril(mx.ones((n, n), dtype=mx.bool_)),
            )
            if head is not None and head.usable(n):
                mx.eval(draft, out)
                if head.targets(out) is None:
                    mx.eval(mx.argmax(llm.logits(out), axis=-1))
            else:
                mx.eval(draft, mx.argmax(llm.logits(out), axis=-1))
            if r:
                times[n].append(time.perf_counter() - tic)
            for c in cache:
                c.trim(n)
    return [statistics.median(t) for t in times.values()]
