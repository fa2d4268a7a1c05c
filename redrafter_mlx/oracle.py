"""An oracle proposer: drafts taken from a known continuation (an upper bound for benchmarks).

Given the sequence the LLM will produce (for greedy decoding: its own greedy output), the
oracle recognises where generation stands from the hidden state it is handed (nearest
reference hidden state among the positions that produced ``g0``) and proposes the true
continuation as beam 0. The other beams follow it to depth ``w`` and then deviate, so the tree
has real branches. All on the device, like the real beam search, so the generation loop runs
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .llm import TreeLLM


class OracleProposer:
    def __init__(
        self,
        llm: TreeLLM,
        prompt: Sequence[int],
        continuation: Sequence[int],
        width: int,
        length: int,
        vocab_size: int,
    ):
        if width < 1 or length < 2:
            raise ValueError(f"oracle needs width >= 1 and length >= 2, got {width}, {length}")
        seq = [int(t) for t in prompt] + [int(t) for t in continuation]
        # Reference hidden states: position j produced seq[j + 1].
        hidden = llm.adapter.hidden_states(llm.model, mx.array(seq[:-1])[None], cache=None)[0]
        first = len(prompt) - 1
        self.hidden = hidden[first:].astype(mx.float32)  # [T, H]
        self.produced = mx.array(seq[first + 1 :], dtype=mx.int32)  # [T], token each produced
        # Padded so that any position has length - 1 future tokens.
        self.future = mx.array(seq[first + 1 :] + [0] * length, dtype=mx.int32)
        self.width, self.length, self.vocab_size = width, length, vocab_size
        mx.eval(self.hidden, self.produced, self.future)  # set-up cost stays out of timings

    def __call__(self, hidden: mx.array, g0: mx.array) -> mx.array:
        W, L = self.width, self.length
        dist = ((self.hidden - hidden.astype(mx.float32)[None]) ** 2).sum(axis=-1)
        dist = mx.where(self.produced == g0, dist, mx.inf)
        j = mx.argmin(dist)
        true = self.future[j + 1 + mx.arange(L - 1)]  # [L-1] drafted continuation
        beams = [true]
        for w in range(1, W):
            deviate = w % (L - 1)  # beam w agrees with the truth on its first `deviate` drafts
            wrong = (true + w) % self.vocab_size
            beams.append(mx.where(mx.arange(L - 1) < deviate, true, wrong))
        drafts = mx.stack(beams)  # [W, L-1]
        root = mx.broadcast_to(g0.astype(mx.int32).reshape(1, 1), (W, 1))
        return mx.concatenate([root, drafts], axis=1)
