"""Greedy targets from the LM head's int8 screen vs the float32 head, in one process.

For each n, on the same prompt cache, times (median of --repeats, the modes alternating):

- ``hidden``: our tree forward over n chain tokens, hidden states only;
- ``full``: the same plus the float32 head and ``greedy_targets`` (what the engine did before);
- ``screen``: the same plus :class:`~redrafter_mlx.greedy_head.GreedyHead` targets;

and checks that both give the same targets. Writes JSON.

    python bench/greedy_head.py --model ~/.cache/redrafter-mlx/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import statistics
import time

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.benchmark import machine_info, primed_cache, timed_on_cache, write_json
from redrafter_mlx.greedy_head import GreedyHead
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.verification import greedy_targets

import mlx.core as mx
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="1,2,3,4,5,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/greedy_head.json")
    args = ap.parse_args()

    model, tokenizer, _ = load(args.model)
    llm = TreeLLM(model)
    tic = time.perf_counter()
    head = GreedyHead.for_model(model)
    if head is None:
        raise SystemExit("no screen here: it needs the few-row kernel and a float32 head")
    build_s = time.perf_counter() - tic
    cache, past = primed_cache(llm, tokenizer)
    rng = np.random.default_rng(0)

    def step(ids: mx.array, mode: str) -> tuple[float, np.ndarray | None]:
        n = ids.shape[0]

        def run() -> np.ndarray | None:
            hidden = llm.hidden_states(
                ids,
                cache,
                mx.arange(past, past + n, dtype=mx.int32),
                ancestors=mx.tril(mx.ones((n, n), dtype=mx.bool_)),
            )
            if mode == "full":
                return np.array(greedy_targets(llm.logits(hidden))[0])
            mx.eval(hidden)
            return head.targets(hidden)[0] if mode == "screen" else None

        return timed_on_cache(cache, n, run)

    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        times: dict[str, list[float]] = {"hidden": [], "full": [], "screen": []}
        for r in range(args.repeats + 1):
            ids = mx.array(rng.integers(0, 30000, n), dtype=mx.int32)
            got = {}
            for mode in times:
                dt, got[mode] = step(ids, mode)
                if r:  # the first round is a warm-up
                    times[mode].append(dt)
            if not np.array_equal(got["full"], got["screen"]):
                raise SystemExit(f"n={n}: the screen's targets differ from the float32 head's")
        row = {"n": n} | {f"{m}_ms": statistics.median(t) * 1e3 for m, t in times.items()}
        rows.append(row)
    info = machine_info()
    print(f"machine: {info}")
    print(f"screen built in {build_s:.1f} s, {head.nbytes / 1e6:.0f} MB; median of {args.repeats}")
    print(f"{'n':>3s} {'hidden ms':>10s} {'full ms':>8s} {'screen ms':>10s} {'screen/full':>11s}")
    for r in rows:
        r["screen_over_full"] = r["screen_ms"] / r["full_ms"]
        print(
            f"{r['n']:3d} {r['hidden_ms']:10.1f} {r['full_ms']:8.1f} {r['screen_ms']:10.1f} "
            f"{r['screen_over_full']:11.2f}"
        )
    write_json(args.out, {"machine": info, "args": vars(args), "past": past, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
