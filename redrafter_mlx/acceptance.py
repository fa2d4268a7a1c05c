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
    continuation: list[int],
    hidden: np.ndarray,
    width: int,
    length: int,
) -> tuple[int, list[int]]:
    """(steps, accepted drafts per step) to emit ``continuation`` after its first token.

    ``hidden[j]`` is the LLM state that produced ``continuation[j]`` (the first token comes
    from the prompt's forward pass, as in the engine).
    """
    T = len(continuation)
    accepted = []
    pos = 0  # index of the current root g0
    while pos < T - 1:
        beams = beam_search(
            drafter, embed, mx.array(hidden[pos]), mx.array(continuation[pos]), width, length
        ).tokens
        drafts = np.array(beams)[:, 1:]  # [W, L-1]
        future = np.array(continuation[pos + 1 : pos + length] + [-1] * length)[: length - 1]
        match = np.cumprod(drafts == future[None, :], axis=1).sum(axis=1)
        a = int(min(match.max(), T - 2 - pos))  # never past the end of the continuation
        accepted.append(a)
        pos += a + 1
    return len(accepted), accepted
