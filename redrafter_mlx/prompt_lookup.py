"""Prompt lookup: a draft copied from the context, for text that repeats itself.

Code repeats itself (names, signatures, the prompt's docstring quoted back), and a drafter
that sees one hidden state cannot know what the context said forty tokens ago. When the
context's last n tokens occurred earlier in it (prompt and output so far), the tokens that
followed that occurrence make a draft for free. The engine verifies it in place of the
drafter's lowest-ranked beam, so the tree keeps its size (verifying more tokens costs on the
CPU) and nothing is lost but that beam.

A proposal depends only on the tokens already emitted, never on the current step's draws, so
verification stays exact for greedy and sampling alike (see :mod:`.verification`).

On HumanEval's greedy continuations (``python bench/lookup_replay.py``), with W=1 and L=3,
the drafter alone averaged 1.648 tokens/step; with lookup in its place, matching n-grams of
at most 3 and at least 3 / 2 / 1 tokens: 1.806 / 1.831 / 1.745; at most 6 and at least 3 / 2:
1.825 / 1.850, at the same 3 verified tokens per step. Short matches guess wrong more often,
long ones find the right occurrence; hence the engine's defaults below.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The longest n-gram the engine matches, and its default shortest (``--lookup``).
LONGEST_NGRAM = 6
DEFAULT_MIN_NGRAM = 2


class PromptLookup:
    """An index of a growing token context, proposing continuations of its tail.

    Keeps, for every n-gram size from ``ngram`` down to ``min_ngram``, the latest start of each
    n-gram that is followed by at least ``length`` known tokens (so it is never the tail
    itself). :meth:`propose` finds the longest size whose tail n-gram occurred before and
    returns the ``length`` tokens after its latest occurrence. Extending costs O(new tokens);
    proposing is a dictionary lookup per size.
    """

    def __init__(self, tokens: Iterable[int], length: int, ngram: int = 3, min_ngram: int = 0):
        min_ngram = min_ngram or ngram
        if length < 1:
            raise ValueError(f"prompt lookup proposes >= 1 token, got length {length}")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= ngram, got {min_ngram} and {ngram}"
            )
        self.length, self.sizes = length, range(ngram, min_ngram - 1, -1)
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the context."""
        before = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        ts = self.tokens
        for n in self.sizes:
            # Starts with `length` known tokens after them: those below `before - n - length
            # + 1` were indexed by earlier calls.
            latest = self._latest[n]
            for s in range(max(0, before - n - self.length + 1), len(ts) - n - self.length + 1):
                latest[tuple(ts[s : s + n])] = s

    def propose(self) -> list[int] | None:
        """``length`` tokens that followed the latest earlier occurrence of the context's last
        n tokens, for the largest n that has one; None if none has."""
        for n in self.sizes:
            if len(self.tokens) <= n:
                continue
            s = self._latest[n].get(tuple(self.tokens[-n:]))
            if s is not None:
                return self.tokens[s + n : s + n + self.length]
        return None
