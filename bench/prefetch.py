"""The few-row kernel's weight prefetch: whole forwards over n tokens at several distances.

One process, one prompt cache; each round runs every n and every distance in turn (so drift in
the machine's speed spreads over all of them) a forward over n new tokens plus the float32 LM
head, as an autoregressive step (n = 1) or a tree verification takes it. Checks that every
distance gives bit-identical logits, then prints the median per setting, its ratio to the first
distance and how many rounds it won against it. Writes JSON.

    python bench/prefetch.py --model ~/.cache/redrafter-mlx/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import statistics

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx import _blas
from redrafter_mlx.benchmark import (
    chain_hidden,
    machine_info,
    primed_cache,
    timed_on_cache,
    write_json,
)
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load

import mlx.core as mx
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--distances", default="0,512", help="floats ahead; 0: no prefetch")
    ap.add_argument("--sizes", default="1,2,3,4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="bench/results/prefetch.json")
    args = ap.parse_args()
    distances = [int(d) for d in args.distances.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    if _blas.gemm_prefetch() is None:
        raise SystemExit("the few-row kernel is not loaded here (Linux x86-64 with AVX2 only)")

    model, tokenizer, _ = load(args.model)
    llm = TreeLLM(model)
    cache, past = primed_cache(llm, tokenizer)

    def forward(n: int) -> tuple[float, np.ndarray]:
        def run() -> mx.array:
            logits = llm.logits(chain_hidden(llm, cache, past, n))
            mx.eval(logits)
            return logits

        dt, logits = timed_on_cache(cache, n, run)
        return dt, np.array(logits)

    times: dict[tuple[int, int], list[float]] = {}
    first: dict[int, np.ndarray] = {}
    for r in range(args.rounds + 1):
        for n in sizes:
            for d in distances:
                _blas.gemm_prefetch(d)
                dt, logits = forward(n)
                if n not in first:
                    first[n] = logits
                elif not np.array_equal(logits, first[n]):
                    raise SystemExit(f"prefetch {d} changed the logits at n = {n}: a kernel bug")
                if r:  # round 0 warms up shapes and kernels
                    times.setdefault((n, d), []).append(dt)

    info = machine_info()
    print(f"machine: {info}")
    print(
        f"forward + LM head over n tokens, past {past}; median of {args.rounds} rounds (ms); "
        f"ratio and rounds won against prefetch {distances[0]}"
    )
    rows = []
    for n in sizes:
        base = times[(n, distances[0])]
        cells = []
        for d in distances:
            t = times[(n, d)]
            ratio = statistics.median(t) / statistics.median(base)
            won = sum(a < b for a, b in zip(t, base, strict=True))
            ms = statistics.median(t) * 1e3
            rows.append({"n": n, "prefetch": d, "ms": ms, "ratio": ratio, "won": won})
            cells.append(f"{d:>5d}: {ms:6.1f} ({ratio:.3f}, {won:2d} won)")
        print(f"n={n}  " + "   ".join(cells))
    write_json(args.out, {"machine": info, "args": vars(args), "past": past, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
