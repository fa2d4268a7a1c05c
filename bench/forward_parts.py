"""Where a verification forward's time goes: the weight products against everything else.

A tree of n tokens costs more than one token although the kernel streams each weight matrix
once for all n rows. This splits our forward over n tokens (the chain form a W=1 tree takes;
hidden states only, no LM head) into:

- ``forward``: the whole forward, as the engine runs it;
- ``products``: the model's own weight products (every ``nn.Linear`` of its layers, in order)
  on n random activation rows, in one graph: what the kernel costs with these weights;
- ``other``: the same forward with every ``nn.Linear`` replaced by a stand-in that only
  broadcasts one input column to the output's shape: norms, rope, attention, the MLP's
  activation, residuals and MLX's per-operation overhead (plus the stand-ins' own small cost);
- ``swiglu``: mlx-lm's compiled ``swiglu`` on [1, n, intermediate] once per layer (MLX's CPU
  ``exp`` is scalar).

Rounds alternate all n and all parts, so the machine's drift hits them alike; each number is a
median over rounds, and each is also printed relative to n = 1. Writes JSON.

    python bench/forward_parts.py --model ~/.cache/redrafter-mlx/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from functools import partial

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.benchmark import (
    alternating_rounds,
    chain_hidden,
    machine_info,
    primed_cache,
    timed_on_cache,
    write_json,
)
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

PARTS = ("forward", "products", "other", "swiglu")


@contextlib.contextmanager
def stand_in_linears():
    """Every nn.Linear returns its input's first column broadcast to the output's shape."""
    original = nn.Linear.__call__

    def stand_in(self, x):
        return mx.broadcast_to(x[..., :1], (*x.shape[:-1], self.weight.shape[0])) * 1.0

    nn.Linear.__call__ = stand_in
    try:
        yield
    finally:
        nn.Linear.__call__ = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="1,2,3,4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="bench/results/forward_parts.json")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    model, tokenizer, _ = load(args.model)
    llm = TreeLLM(model)
    cache, past = primed_cache(llm, tokenizer)
    layers = model.model.layers
    linears = [m for layer in layers for _, m in layer.named_modules() if type(m) is nn.Linear]
    mlp_width = max(lin.weight.shape[0] for lin in linears)
    n_layers = len(layers)

    def forward(n: int) -> float:
        return timed_on_cache(cache, n, lambda: mx.eval(chain_hidden(llm, cache, past, n)))[0]

    def products(n: int) -> float:
        xs = {k: mx.random.normal((1, n, k)) for k in {lin.weight.shape[1] for lin in linears}}
        mx.eval(list(xs.values()))
        tic = time.perf_counter()
        mx.eval([lin(xs[lin.weight.shape[1]]) for lin in linears])
        return time.perf_counter() - tic

    def other(n: int) -> float:
        with stand_in_linears():
            return forward(n)

    def activation(n: int) -> float:
        g, x = mx.random.normal((1, n, mlp_width)), mx.random.normal((1, n, mlp_width))
        mx.eval(g, x)
        tic = time.perf_counter()
        for _ in range(n_layers):
            mx.eval(swiglu(g, x))
        return time.perf_counter() - tic

    parts = {"forward": forward, "products": products, "other": other, "swiglu": activation}
    calls = {(name, n): partial(parts[name], n) for n in sizes for name in PARTS}
    times = alternating_rounds(calls, args.rounds)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}

    info = machine_info()
    print(f"machine: {info}")
    print(
        f"{len(linears)} weight products over {n_layers} layers; past {past} tokens; "
        f"median of {args.rounds} rounds (ms, and relative to n = {sizes[0]})"
    )
    print(f"{'n':>3s} " + " ".join(f"{p:>16s}" for p in PARTS))
    rows = []
    for n in sizes:
        row = {"n": n} | {f"{p}_ms": ms[(p, n)] for p in PARTS}
        row |= {f"{p}_rel": ms[(p, n)] / ms[(p, sizes[0])] for p in PARTS}
        rows.append(row)
        print(f"{n:3d} " + " ".join(f"{ms[(p, n)]:9.1f} ({row[f'{p}_rel']:.2f})" for p in PARTS))
    write_json(args.out, {"machine": info, "args": vars(args), "past": past, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
