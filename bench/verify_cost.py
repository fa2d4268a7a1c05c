"""What one verification forward costs: a tree of n tokens vs mlx-lm's plain forward of n.

For each n, on the same prompt cache, times (median of --repeats):

- ``plain``: the unmodified mlx-lm model over n new tokens (causal mask), logits for all n;
- ``chain``: our tree forward over the same n tokens as a one-beam tree (per-token rope
  positions, boolean ancestor mask), logits for all n;
- ``tree``: our tree forward over a tree of n tokens with W branches (the shape beam search
  produces at width W), same n.

and divides by the plain forward of one token (an AR step without mlx-lm's pipelining). Rounds
alternate every n and every form, so the machine's drift hits them alike; the first round is a
warm-up (shapes, kernels). The cache is trimmed back after every forward, so every call sees the
same past. Writes JSON.

    python bench/verify_cost.py --model ~/.cache/redrafter-mlx/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.benchmark import (
    alternating_rounds,
    machine_info,
    primed_cache,
    timed_on_cache,
    write_json,
)
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.tree_attention import PackedTree

import mlx.core as mx
import numpy as np


def branching_tree(n: int, width: int) -> PackedTree:
    """A packed tree of n tokens: W chains hanging off one root, nodes dealt round-robin
    (the shape beam search gives when its W beams share only the root)."""
    depths, parents, last = [0], [-1], [0] * width
    for i in range(1, n):
        b = (i - 1) % width
        parents.append(last[b])
        depths.append(depths[last[b]] + 1)
        last[b] = i
    return PackedTree(
        tokens=np.arange(7, 7 + n, dtype=np.int32),
        depths=np.array(depths, dtype=np.int32),
        parents=np.array(parents, dtype=np.int32),
        unpacker=np.zeros((1, 1), dtype=np.int32),  # unused here
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="1,2,3,4,5,7,9,13,17")
    ap.add_argument("--width", type=int, default=4, help="branches of the 'tree' shape")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/verify_cost.json")
    args = ap.parse_args()

    model, tokenizer, _ = load(args.model)
    llm = TreeLLM(model)
    cache, past = primed_cache(llm, tokenizer)
    rng = np.random.default_rng(0)

    def plain(ids: mx.array) -> mx.array:  # mlx-lm's own forward: logits [1, n, V]
        return model(ids[None], cache=cache)

    def tree_forward(ids: mx.array, pos: mx.array, anc: mx.array) -> mx.array:
        return llm.logits(llm.hidden_states(ids, cache, pos, ancestors=anc))  # [n, V]

    def timed(fn, *inputs: mx.array) -> float:
        return timed_on_cache(cache, inputs[0].shape[0], lambda: mx.eval(fn(*inputs)))[0] * 1e3

    sizes = [int(s) for s in args.sizes.split(",")]
    calls = {}  # (n, form) -> a timed forward, ms
    for n in sizes:
        ids = mx.array(rng.integers(0, 30000, n), dtype=mx.int32)
        chain = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        pos = mx.arange(past, past + n, dtype=mx.int32)
        tree = branching_tree(n, args.width)
        t_ids = mx.array(tree.tokens)
        t_pos, t_anc = mx.array(tree.positions(past)), mx.array(tree.ancestor_mask())
        calls[n, "plain"] = partial(timed, plain, ids)
        calls[n, "chain"] = partial(timed, tree_forward, ids, pos, chain)
        calls[n, "tree"] = partial(timed, tree_forward, t_ids, t_pos, t_anc)
    times = alternating_rounds(calls, args.repeats)
    rows = [
        {"n": n}
        | {f"{form}_ms": statistics.median(times[n, form]) for form in ("plain", "chain", "tree")}
        for n in sizes
    ]
    one = rows[0]["plain_ms"] if sizes[0] == 1 else None
    info = machine_info()
    print(f"machine: {info}")
    print(f"past {past} tokens; tree shape: {args.width} branches; median of {args.repeats} rounds")
    print(
        f"{'n':>3s} {'plain ms':>9s} {'chain ms':>9s} {'tree ms':>8s} {'tree/plain':>10s} "
        f"{'plain/AR':>9s}"
    )
    for r in rows:
        r["tree_over_plain"] = r["tree_ms"] / r["plain_ms"]
        r["plain_over_one"] = r["plain_ms"] / one if one else None
        rel = f"{r['plain_over_one']:9.2f}" if one else f"{'-':>9s}"
        print(
            f"{r['n']:3d} {r['plain_ms']:9.1f} {r['chain_ms']:9.1f} {r['tree_ms']:8.1f} "
            f"{r['tree_over_plain']:10.2f} {rel}"
        )
    write_json(args.out, {"machine": info, "args": vars(args), "past": past, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
