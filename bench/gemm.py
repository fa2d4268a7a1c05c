"""Few-row products x @ W^T (decoding's shape) with the kernel vs the BLAS alone, same machine.

For each weight shape of the demo model (random float32 weights, several copies so they stream
from memory as in a forward) and each row count M, times MLX's own ``x @ W.T`` (median of
--repeats) here, where the few-row kernel is on, and in a child process with
``REDRAFTER_GEMM_ROWS=0`` (the BLAS alone, MKL or OpenBLAS), then prints GB/s of weights
streamed, the kernel's cost relative to M = 1, and kernel/BLAS ratios. Writes JSON.

    python bench/gemm.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import redrafter_mlx  # noqa: F401  (first: loads the kernel and the BLAS)
from redrafter_mlx import _blas
from redrafter_mlx.benchmark import machine_info, write_json

import mlx.core as mx

#: (name, N, K, copies): Qwen2.5-0.5B's lm_head, MLP gate/up and down projections, q/o projection.
SHAPES = [
    ("lm_head", 151936, 896, 1),
    ("mlp_up", 4864, 896, 24),
    ("mlp_down", 896, 4864, 24),
    ("attn_q", 896, 896, 48),
]


def measure(rows: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """{shape: {M: seconds}} for every shape and row count, in this process."""
    out: dict[str, dict[int, float]] = {}
    for name, n, k, copies in SHAPES:
        weights = [mx.random.normal((n, k)) * 0.02 for _ in range(copies)]
        mx.eval(weights)
        out[name] = {}
        for m in rows:
            x = mx.random.normal((m, k))
            mx.eval(x)
            times = []
            for r in range(repeats + 1):
                tic = time.perf_counter()
                mx.eval([x @ w.T for w in weights])
                if r:  # the first is a warm-up
                    times.append(time.perf_counter() - tic)
            out[name][m] = statistics.median(times)
        del weights
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/gemm.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:  # the BLAS-alone side: print the timings for the parent
        print(json.dumps(measure(rows, args.repeats)))
        return
    if _blas.gemm != "on":
        sys.exit(f"the few-row kernel is not on here ({_blas.summary()}): nothing to compare")
    kernel = measure(rows, args.repeats)
    env = os.environ | {"REDRAFTER_GEMM_ROWS": "0"}
    child = [sys.executable, __file__, "--child", "--rows", args.rows]
    child += ["--repeats", str(args.repeats)]
    done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
    blas = {s: {int(m): t for m, t in v.items()} for s, v in json.loads(done.stdout).items()}

    info = machine_info()
    print(f"machine: {info}")
    print(
        f"{'shape':>9s} {'M':>3s} {'kernel GB/s':>11s} {'BLAS GB/s':>10s} {'kernel/BLAS':>11s} "
        f"{'kernel vs M=1':>13s}"
    )
    table = []
    for name, n, k, copies in SHAPES:
        gb = n * k * 4 * copies / 1e9
        for m in rows:
            t_k, t_b = kernel[name][m], blas[name][m]
            row = {
                "shape": name, "N": n, "K": k, "copies": copies, "M": m,
                "kernel_ms": t_k * 1e3, "blas_ms": t_b * 1e3,
                "kernel_gbs": gb / t_k, "blas_gbs": gb / t_b,
                "kernel_over_blas": t_k / t_b, "kernel_over_one": t_k / kernel[name][rows[0]],
            }  # fmt: skip
            table.append(row)
            print(
                f"{name:>9s} {m:3d} {row['kernel_gbs']:11.1f} {row['blas_gbs']:10.1f} "
                f"{row['kernel_over_blas']:11.2f} {row['kernel_over_one']:13.2f}"
            )
    write_json(args.out, {"machine": info, "args": vars(args), "rows": table})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
