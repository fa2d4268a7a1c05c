"""What drawing the verification targets costs: the full top-p sort vs the nucleus shortcuts.

Each verification step draws one target per tree node from the LLM's processed distribution.
mlx-lm's ``apply_top_p`` sorts the whole vocabulary per row; ``verification.sample_rows`` looks
for the nucleus among the 1024 likeliest tokens and falls back to the full sort only when that
cannot decide a row exactly; ``verification.host_draw`` (what the engine uses, row by row on
the evaluated logits) does the same in NumPy and leaves rows that float32 rounding could decide
to ``sample_rows``. This times all three on real logits: the LLM's rows over its own greedy
answers to HumanEval prompts, in groups of n rows (a tree of n nodes), and reports the median
per group, the ratios, and how many rows each shortcut decided. Where the LM head has an int8
screen (Linux x86-64, float32) it also times what the engine's walk costs from the hidden
states, with the head: the float32 head and ``host_draw`` against ``nucleus_screen`` (which
leaves the rows it cannot decide to the logits). Writes JSON.

    python bench/sampling.py --model ~/.cache/redrafter-mlx/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import statistics
import time

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.benchmark import humaneval_prompts, machine_info, write_json
from redrafter_mlx.generate import prefill
from redrafter_mlx.greedy_head import GreedyHead
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.nucleus_screen import ScreenedNucleus
from redrafter_mlx.verification import (
    NUCLEUS_CANDIDATES,
    SamplingParams,
    draw_target,
    host_nucleus,
    nucleus,
    sample_rows,
    sampling_logits,
)

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step


def answer_hidden(llm: TreeLLM, tokenizer, prompt: str, tokens: int) -> mx.array:
    """The LLM's final hidden states [tokens, H] at each position of its own greedy answer to
    ``prompt`` (the logits are one ``llm.logits`` away)."""
    model = llm.model
    ids = tokenizer.encode(prompt)

    def greedy(x: mx.array) -> mx.array:
        return mx.argmax(x, axis=-1)

    answer = [
        int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=tokens, sampler=greedy)
    ]
    cache = llm.make_cache()
    prefill(llm, cache, ids[:-1])
    hidden = llm.hidden_states(mx.array(ids[-1:] + answer[:-1]), cache, positions=len(ids) - 1)
    mx.eval(hidden)
    return hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="0-4", help="HumanEval problems")
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--sizes", default="1,2,4", help="rows drawn together (tree nodes)")
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", default="bench/results/sampling.json")
    args = ap.parse_args()

    model, tokenizer, _ = load(args.model)
    llm = TreeLLM(model)
    params = SamplingParams(temp=args.temp, top_p=args.top_p)
    prompts = humaneval_prompts(args.prompts)
    hidden = mx.concatenate([answer_hidden(llm, tokenizer, p, args.answer_tokens) for p in prompts])
    rows = llm.logits(hidden)
    mx.eval(rows)
    head = GreedyHead.for_model(model)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    ids, _, keep, exact = nucleus(logprobs, args.top_p)
    sizes = keep.sum(axis=-1)
    mx.eval(sizes, exact)
    nucleus_sizes = sorted(sizes.tolist())

    def full(x: mx.array) -> mx.array:  # what mlx-lm's sampler does, row by row
        return mx.random.categorical(sampling_logits(x, params), axis=-1)

    rng = np.random.default_rng(0)

    def host(x: mx.array) -> mx.array:  # the engine's walk: each row as walk_targets draws it
        return mx.array([draw_target(x, i, params, rng) for i in range(x.shape[0])])

    def with_head(x: mx.array) -> mx.array:  # the walk from hidden states: the float32 head
        return host(llm.logits(x))

    screen_rng = np.random.default_rng(0)

    def screened(x: mx.array) -> mx.array:  # the walk from hidden states: the int8 screen
        screen, logits = ScreenedNucleus(head, x, params).draw, llm.logits(x)
        n = x.shape[0]
        return mx.array([draw_target(logits, i, params, screen_rng, screen) for i in range(n)])

    def timed(fn, n: int, source: mx.array = rows) -> float:
        times = []
        for s in range(0, source.shape[0] - n + 1, n):
            x = source[s : s + n]
            mx.eval(x)
            tic = time.perf_counter()
            mx.eval(fn(x, params) if fn is sample_rows else fn(x))
            times.append(time.perf_counter() - tic)
        return statistics.median(times[1:]) * 1e3  # the first call warms up

    mx.random.seed(0)
    results = []
    for n in [int(s) for s in args.sizes.split(",")]:
        full_ms, fast_ms, host_ms = timed(full, n), timed(sample_rows, n), timed(host, n)
        results.append(
            {
                "rows": n,
                "full_ms": full_ms,
                "nucleus_ms": fast_ms,
                "host_ms": host_ms,
                "ratio": full_ms / fast_ms,
                "host_ratio": full_ms / host_ms,
            }
        )
        if head is not None and head.usable(n):
            head_ms, screen_ms = timed(with_head, n, hidden), timed(screened, n, hidden)
            results[-1].update(
                head_host_ms=head_ms, screen_ms=screen_ms, screen_ratio=head_ms / screen_ms
            )

    info = machine_info()
    decided = sum(exact.tolist())
    host_decided = sum(host_nucleus(r, args.top_p) is not None for r in np.asarray(rows))
    screen_decided = None
    if head is not None:
        screen = ScreenedNucleus(head, hidden, params)
        screen_decided = sum(screen.nucleus(i) is not None for i in range(hidden.shape[0]))
    print(f"machine: {info}")
    print(
        f"{rows.shape[0]} rows, vocabulary {rows.shape[1]}, T={args.temp} top-p {args.top_p}; "
        f"nucleus size median {statistics.median(nucleus_sizes)}, max {nucleus_sizes[-1]}; "
        f"decided among {NUCLEUS_CANDIDATES} candidates: {decided}/{rows.shape[0]}; "
        f"in NumPy: {host_decided}/{rows.shape[0]}; "
        f"by the int8 screen: {screen_decided}/{rows.shape[0]}"
    )
    print(
        f"{'rows':>4s} {'full sort ms':>12s} {'nucleus ms':>10s} {'NumPy ms':>9s} "
        f"{'full/nucleus':>12s} {'full/NumPy':>10s}"
    )
    for r in results:
        print(
            f"{r['rows']:4d} {r['full_ms']:12.2f} {r['nucleus_ms']:10.2f} {r['host_ms']:9.2f} "
            f"{r['ratio']:11.2f}x {r['host_ratio']:9.2f}x"
        )
    if any("screen_ms" in r for r in results):
        print("from hidden states, the LM head included (every row of a group drawn):")
        print(f"{'rows':>4s} {'head + NumPy ms':>15s} {'int8 screen ms':>14s} {'ratio':>6s}")
        for r in results:
            if "screen_ms" in r:
                print(
                    f"{r['rows']:4d} {r['head_host_ms']:15.2f} {r['screen_ms']:14.2f} "
                    f"{r['screen_ratio']:5.2f}x"
                )
    write_json(
        args.out,
        {
            "machine": info,
            "args": vars(args),
            "vocabulary": rows.shape[1],
            "rows_total": rows.shape[0],
            "decided": decided,
            "host_decided": host_decided,
            "screen_decided": screen_decided,
            "nucleus_sizes": nucleus_sizes,
            "results": results,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
