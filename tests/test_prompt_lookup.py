"""Prompt lookup's index against a brute-force search of the context."""

from redrafter_mlx.prompt_lookup import PromptLookup

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def brute_force(tokens: list[int], length: int, ngram: int, min_ngram: int) -> list[int] | None:
    for n in range(ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for s in range(len(tokens) - n - length, -1, -1):  # latest first, `length` after it
            if tokens[s : s + n] == tail:
                return tokens[s + n : s + n + length]
    return None


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    length=st.integers(1, 5),
    ngram=st.integers(1, 4),
    drop=st.integers(0, 3),
)
def test_proposals_equal_a_brute_force_search(tokens, cuts, length, ngram, drop):
    """Extended in arbitrary chunks, the index proposes what a scan of the context finds."""
    min_ngram = max(1, ngram - drop)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    lookup = PromptLookup(tokens[: bounds[0]], length, ngram, min_ngram)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        lookup.extend(tokens[lo:hi])
        got = lookup.propose()
        assert got == brute_force(tokens[:hi], length, ngram, min_ngram)
        assert got is None or len(got) == length


def test_the_latest_and_longest_match_wins():
    # "1 2 3" occurs twice before the tail: the later one (followed by 7 8) is proposed.
    ctx = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    assert PromptLookup(ctx, 2).propose() == [7, 8]
    # Only the 1-gram "3" recurs with 2 tokens after it when n may drop to 1.
    ctx = [3, 5, 6, 0, 4, 3]
    assert PromptLookup(ctx, 2).propose() is None
    assert PromptLookup(ctx, 2, ngram=3, min_ngram=1).propose() == [5, 6]
    # A match too close to the end to be followed by `length` tokens is skipped.
    assert PromptLookup([1, 2, 1, 2, 1, 2], 3, ngram=2).propose() == [1, 2, 1]
    assert PromptLookup([1, 2, 1, 2], 3, ngram=2).propose() is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="length"):
        PromptLookup([], 0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup([], 2, ngram=2, min_ngram=3)
