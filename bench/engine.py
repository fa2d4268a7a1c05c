"""ReDrafter vs mlx-lm autoregressive decoding on one model, in one process.

Runs mlx-lm's AR baseline and ReDrafter (random untrained drafter and/or oracle drafts, an
upper bound) alternately on the same prompts; prints medians, speed ratios, machine and
versions; writes a JSON result.

    python bench/engine.py --model ~/.cache/redrafter-mlx/models/qwen2.5-coder-0.5b-instruct \
        --prompts 0-4 --max-tokens 64 --width 4 --length 5 --out bench/results/engine.json
"""

from __future__ import annotations

import argparse
import time

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.benchmark import (
    compare,
    humaneval_prompts,
    machine_info,
    summarize,
    write_json,
)
from redrafter_mlx.drafter import Drafter, DrafterConfig
from redrafter_mlx.generate import (
    GenerationSummary,
    StepOutput,
    StepStats,
    stream_autoregressive,
    stream_redrafter,
)
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load, model_dims
from redrafter_mlx.oracle import OracleProposer

import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", help="trained drafter folder (default: a random one)")
    ap.add_argument("--prompts", default="0-4", help="HumanEval problem range")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--length", type=int, default=5)
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=32768,
        help="random drafter: predict over the first N token ids (0: full vocab)",
    )
    ap.add_argument(
        "--modes",
        default="ar,drafter,oracle",
        help="of ar (ours, the baseline), mlx_lm (mlx-lm's stream_generate), drafter, "
        "eager (drafter without mx.compile), oracle",
    )
    ap.add_argument("--profile", action="store_true", help="time draft/verify (adds syncs)")
    ap.add_argument("--out", default="bench/results/engine.json")
    args = ap.parse_args()

    model, tokenizer, drafter = load(args.model, args.drafter)
    llm = TreeLLM(model)
    hidden, vocab = model_dims(model)
    if drafter is None:
        dv = list(range(args.draft_vocab)) if args.draft_vocab else None
        mx.random.seed(0)
        drafter = Drafter(DrafterConfig(vocab_size=vocab, hidden_size=hidden, draft_vocab=dv))
        mx.eval(drafter.parameters())
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    stop = tokenizer.eos_token_ids
    W, L, n = args.width, args.length, args.max_tokens
    references: dict[tuple, list[int]] = {}

    def ar(ids):
        def run():
            out = []
            for step in stream_autoregressive(model, ids, max_tokens=n, stop_tokens=stop):
                out += step.tokens
                yield step
            references[tuple(ids)] = out

        return run()

    def mlx_lm_api(ids):  # mlx-lm's public stream_generate: is our baseline wrapper free?
        summary = GenerationSummary(prompt_tokens=len(ids))
        mx.reset_peak_memory()
        tic = last = time.perf_counter()
        start = None
        for r in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=n):
            now = time.perf_counter()
            if start is None:
                summary.prompt_time, start = now - tic, now
            else:
                summary.steps += 1
                summary.generation_time = now - start
            if r.finish_reason == "stop":  # mlx-lm yields the stop token; we never do
                break
            summary.generation_tokens += 1
            summary.peak_memory_gb = mx.get_peak_memory() / 1e9
            yield StepOutput([r.token], StepStats(1, 0, 1, now - last), summary)
            last = now

    propose = make_proposer(drafter, llm.embed, W, L)
    propose_eager = make_proposer(drafter, llm.embed, W, L, compiled=False)

    def with_drafter(ids):
        return stream_redrafter(
            llm, propose, ids, max_tokens=n, stop_tokens=stop, profile=args.profile
        )

    def eager(ids):  # the same drafter, beam search not mx.compile'd
        return stream_redrafter(
            llm, propose_eager, ids, max_tokens=n, stop_tokens=stop, profile=args.profile
        )

    def oracle(ids):
        ref = references.get(tuple(ids))
        if ref is None:  # warm-up
            ref = [0] * n
        prop = OracleProposer(llm, ids, ref, W, L, vocab)
        return stream_redrafter(
            llm, prop, ids, max_tokens=n, stop_tokens=stop, profile=args.profile
        )

    runners = {
        "ar": ar,
        "mlx_lm": mlx_lm_api,
        "drafter": with_drafter,
        "eager": eager,
        "oracle": oracle,
    }
    modes = args.modes.split(",")
    if "ar" not in modes:
        raise SystemExit("--modes must include ar (the baseline)")
    runners = {k: v for k, v in runners.items() if k in modes}

    info = machine_info()
    print(f"machine: {info}")
    tic = time.perf_counter()
    results = compare(
        prompts,
        runners,
        on_result=lambda r: print(
            f"  prompt {r.prompt_index:3d} {r.name:8s} {r.generation_tps:6.2f} tok/s "
            f"{r.tokens_per_step:5.2f} tok/step {len(r.tokens):4d} tokens",
            flush=True,
        ),
    )
    table = summarize(results, baseline="ar")
    print(
        f"\nW={W} L={L} max_tokens={n} prompts={args.prompts} ({time.perf_counter() - tic:.0f} s)"
    )
    print(
        f"{'mode':10s} {'tok/s':>8s} {'speedup':>8s} {'tok/step':>9s} {'ms/step':>8s} "
        f"{'peak GB':>8s} same  phases (ms)"
    )
    for name, row in table.items():
        phases = " ".join(f"{k}={v:.0f}" for k, v in row["phase_ms"].items())
        print(
            f"{name:10s} {row['generation_tps']:8.2f} {row['speedup']:7.2f}x "
            f"{row['tokens_per_step']:9.2f} {row['step_ms']:8.0f} {row['peak_memory_gb']:8.2f} "
            f"{row['identical_to_baseline']}/{row['prompts']}  {phases}"
        )
    write_json(args.out, {"machine": info, "args": vars(args), "summary": table, "runs": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
