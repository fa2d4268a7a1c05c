"""Tokens per step without running the LLM's verification: replaying a known continuation.

Verification emits exactly the continuation the LLM produces on its own (greedy: its greedy
output; sampling: a sample from its distribution, see :mod:`.verification`), and a step
accepts the longest prefix of a beam that matches the next tokens of that continuation. So
given a continuation and the LLM's hidden state at each of its positions (one batched
generation), a drafter's tokens/step for any beam shape follows from running the drafter
alone. This is how the drafter card's W x L tables are measured; tests check it against the
real engine.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from .beam_search import beam_search
from .drafter import Drafter


def replay(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    continuations: list[list[int]],
    hidden: list[np.ndarray],
    width: int,
    length: int,
) -> list[list[int]]:
    """Accepted drafts per step for each continuation (its first token excluded).

    ``hidden[i][j]`` is the LLM state that produced ``continuations[i][j]`` (the first token
    comes from the prompt's forward pass, as in the engine). All sequences advance together,
    so each step is one batched beam search.
    """
    pos = [0] * len(continuations)  # index of each sequence's current root g0
    accepted: list[list[int]] = [[] for _ in continuations]
    while True:
        active = [i for i, c in enumerate(continuations) if pos[i] < len(c) - 1]
        if not active:
            return accepted
        h = mx.array(np.stack([hidden[i][pos[i]] for i in active]).astype(np.float32))
        g0 = mx.array([continuations[i][pos[i]] for i in active])
        drafts = np.array(beam_search(drafter, embed, h, g0, width, length).tokens)[:, :, 1:]
        for row, i in enumerate(active):
            c, p = continuations[i], pos[i]
            future = np.array((c[p + 1 : p + length] + [-1] * length)[: length - 1])
            match = np.cumprod(drafts[row] == future[None, :], axis=1).sum(axis=1)
            a = int(min(match.max(), len(c) - 2 - p))  # never past the continuation's end
            accepted[i].append(a)
            pos[i] = p + a + 1


def tokens_per_step(accepted: list[list[int]]) -> float:
    """Mean emitted tokens per step over all sequences."""
    steps = sum(len(a) for a in accepted)
    return (sum(sum(a) for a in accepted) + steps) / max(steps, 1)
