"""Dynamic tree attention: pack beams that share prefixes into one prefix tree.

The W beams of a draft often share their first tokens. Each (beam, depth) token is *owned* by
the lowest-index beam with the same prefix; owned tokens are packed, beam by beam and depth by
depth, into one sequence of ``n <= 1 + W * (L - 1)`` tokens that the LLM verifies in a single
forward pass. A packed token attends to the cached past and to its own ancestors only, at
position ``past + depth``; the *unpacker* maps every (beam, depth) back to its packed index.

Example: beams ``[[91,92,93,95],[91,92,94,96],[91,92,93,97]]`` pack to
``[91,92,93,95,94,96,97]`` with depths ``[0,1,2,3,2,3,3]`` and unpacker
``[[0,1,2,3],[0,1,4,5],[0,1,2,6]]``.

Packing happens on the host with NumPy: the beams are tiny (W * L <= a few dozen ids), and the
tree's size decides the shape of the verification forward. :func:`attend` is the attention the
LLM runs over ``[past | tree]`` during that forward (``redrafter_mlx/llm.py`` routes it there).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class PackedTree:
    tokens: np.ndarray  # [n] int32, packed token ids; tokens[0] is the shared root g0
    depths: np.ndarray  # [n] int32, depth of each packed token (root: 0)
    parents: np.ndarray  # [n] int32, packed index of each token's parent (root: -1)
    unpacker: np.ndarray  # [W, L] int32, packed index of every (beam, depth)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: entry (i, j) is True when packed token j is i itself or an ancestor."""
        n = self.size
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):  # parents precede children in the packed order
            p = self.parents[i]
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def attention_mask(self, past: int) -> np.ndarray:
        """[n, past + n] bool: every packed token sees the whole cached past and its ancestors."""
        return np.concatenate([np.ones((self.size, past), dtype=bool), self.ancestor_mask()], 1)

    def children(self) -> list[dict[int, int]]:
        """Per packed node, its children as {token id: packed index} (tokens are distinct)."""
        kids: list[dict[int, int]] = [{} for _ in range(self.size)]
        for i in range(1, self.size):
            kids[int(self.parents[i])][int(self.tokens[i])] = i
        return kids

    def positions(self, past: int) -> np.ndarray:
        """[n] int32 absolute positions: ``past + depth``."""
        return (past + self.depths).astype(np.int32)

    def node_values(self, per_beam: np.ndarray) -> np.ndarray:
        """Per-(beam, depth) values [W, L] that agree on shared prefixes -> per node [n]."""
        out = np.empty(self.size, dtype=np.asarray(per_beam).dtype)
        out[self.unpacker] = per_beam
        return out

    def subtree(self, keep: np.ndarray) -> tuple[PackedTree, np.ndarray]:
        """The tree of the packed nodes ``keep`` (ascending, root included, every kept node's
        parent kept too), and the [W, L] bool mask of the (beam, depth) entries that survive.

        A dropped (beam, depth) maps to its deepest kept ancestor in the new unpacker; the
        caller must also make its drafted token unacceptable (see ``NO_TOKEN``).
        """
        keep = np.asarray(keep, dtype=np.int64)
        new = np.full(self.size, -1, dtype=np.int32)
        new[keep] = np.arange(keep.size, dtype=np.int32)
        parents = self.parents[keep]
        if keep.size == 0 or keep[0] != 0 or np.any(new[parents[1:]] < 0):
            raise ValueError("a subtree must keep the root and the parent of every kept node")
        kept = new[self.unpacker] >= 0  # [W, L]; ancestor-closed, so a prefix of each row
        unpacker = new[self.unpacker]
        for d in range(1, unpacker.shape[1]):  # dropped -> the kept ancestor before it
            unpacker[:, d] = np.where(kept[:, d], unpacker[:, d], unpacker[:, d - 1])
        sub = PackedTree(
            tokens=self.tokens[keep],
            depths=self.depths[keep],
            parents=np.concatenate([[-1], new[parents[1:]]]).astype(np.int32),
            unpacker=unpacker,
        )
        return sub, kept


#: Stands in for a dropped drafted token: no LLM target (a token id, or -1 for an unvisited
#: node in sampling) ever equals it, so acceptance stops before it.
NO_TOKEN = -2


def pack_beams(beams: np.ndarray) -> PackedTree:
    """Deduplicate shared prefixes of ``beams`` [W, L] (all beams start with the same root)."""
    beams = np.asarray(beams)
    if beams.ndim != 2 or beams.shape[1] < 1:
        raise ValueError(f"beams must have shape [W, L] with L >= 1, got {beams.shape}")
    if not np.all(beams[:, 0] == beams[0, 0]):
        raise ValueError("all beams must start with the same guaranteed token")
    W, L = beams.shape
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = []
    unpacker = np.empty((W, L), dtype=np.int32)
    rows = beams.tolist()
    for b, row in enumerate(rows):
        parent = -1
        for d in range(L):
            key = tuple(row[: d + 1])
            i = index.get(key)
            if i is None:
                i = index[key] = len(tokens)
                tokens.append(row[d])
                depths.append(d)
                parents.append(parent)
            unpacker[b, d] = i
            parent = i
    return PackedTree(
        tokens=np.asarray(tokens, dtype=np.int32),
        depths=np.asarray(depths, dtype=np.int32),
        parents=np.asarray(parents, dtype=np.int32),
        unpacker=unpacker,
    )


def unpack(tree: PackedTree, packed: np.ndarray) -> np.ndarray:
    """Scatter per-packed-token values [n, ...] back to (beam, depth): [W, L, ...]."""
    return np.asarray(packed)[tree.unpacker]


def attend(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """Attention of n new tokens (a tree or a short chain) over ``[past | new]`` keys.

    queries: [B, Hq, n, D]; keys, values: [B, Hkv, S, D]; mask: None, ``"causal"`` (the n new
    tokens are the last n of S) or an [n, S] boolean (True: attend) or additive array.
    Returns [B, Hq, n, D], what ``mx.fast.scaled_dot_product_attention`` returns. The
    ``Hq / Hkv`` query heads that share a KV head are folded into the rows of one product per KV
    head; MLX's CPU path multiplies each query head on its own. Folding made a 2-3 token forward
    of Qwen2.5-0.5B 5-14% cheaper on the 2-core AMD machine (``python bench/verify_cost.py``:
    "chain" against mlx-lm's "plain").
    """
    B, Hq, n, D = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    rep = Hq // Hkv
    q = (queries * scale).reshape(B, Hkv, rep * n, D)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(B, Hkv, rep, n, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}; expected 'causal' or an array")
        mask = mx.arange(S - n, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hkv, rep * n, S)
    return (weights @ values).reshape(B, Hq, n, D)
