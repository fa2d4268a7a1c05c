"""Tokens/step of a drafter over a W x L grid on HumanEval, greedy and sampled.

The LLM answers each problem once per mode (batched, keeping its hidden states); every
(W, L) is then replayed with the drafter alone (see redrafter_mlx/acceptance.py), which is
exact for greedy decoding and has the engine's distribution for sampling. A few problems are
also run through the real engine as a check that the replay matches it.

    python bench/drafter_card.py --drafter models/qwen2.5-coder-0.5b-instruct/drafter \
        --problems 0-99 --out bench/results/card.json
"""

from __future__ import annotations

import argparse
import time

from redrafter_mlx import registry
from redrafter_mlx.acceptance import replay, tokens_per_step
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.benchmark import consume, humaneval_prompts, machine_info, write_json
from redrafter_mlx.distill_data import greedy_with_hidden
from redrafter_mlx.generate import stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.verification import SamplingParams

import mlx.core as mx


def answers(model, prompts, max_tokens, stop, sampling, batch) -> tuple[list, list]:
    conts, hidden = [], []
    for s in range(0, len(prompts), batch):
        for a, h in greedy_with_hidden(model, prompts[s : s + batch], max_tokens, stop, sampling):
            conts.append(a)
            hidden.append(h)
    return conts, hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="registry name or folder (default: demo)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--problems", default="0-99")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="1,2,4")
    ap.add_argument("--lengths", default="3,4,5,6")
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--check", type=int, default=3, help="problems also run in the engine")
    ap.add_argument("--out", default="bench/results/drafter_card.json")
    args = ap.parse_args()

    model_dir, _ = registry.resolve_model(args.model)
    model, tokenizer, drafter = load(model_dir, args.drafter)
    llm = TreeLLM(model)
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.problems)]
    stop = set(tokenizer.eos_token_ids)
    widths = [int(w) for w in args.widths.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    modes = {
        "greedy": SamplingParams(),
        f"T={args.temp},top_p={args.top_p}": SamplingParams(temp=args.temp, top_p=args.top_p),
    }
    table: dict[str, dict[str, float]] = {}
    check = []
    for mode, sampling in modes.items():
        mx.random.seed(0)
        tic = time.perf_counter()
        conts, hidden = answers(model, prompts, args.max_tokens, stop, sampling, args.batch)
        print(f"{mode}: {sum(map(len, conts))} answer tokens in {time.perf_counter() - tic:.0f} s")
        table[mode] = {}
        for W in widths:
            for L in lengths:
                tic = time.perf_counter()
                acc = replay(drafter, llm.embed, conts, hidden, W, L)
                table[mode][f"W={W},L={L}"] = tokens_per_step(acc)
                print(
                    f"  W={W} L={L}: {tokens_per_step(acc):.2f} tokens/step "
                    f"({time.perf_counter() - tic:.0f} s)",
                    flush=True,
                )
        if sampling.greedy:  # the replay must agree with the engine
            for i in range(min(args.check, len(prompts))):
                W, L = widths[-1], lengths[-1]
                propose = make_proposer(drafter, llm.embed, W, L)
                stream = stream_redrafter(
                    llm, propose, prompts[i], max_tokens=len(conts[i]), stop_tokens=stop
                )
                r = consume("engine", i, stream)
                replayed = replay(drafter, llm.embed, [conts[i]], [hidden[i]], W, L)[0]
                check.append(
                    {
                        "problem": i,
                        "engine_steps": r.steps,
                        "replay_steps": len(replayed),
                        "same_tokens": r.tokens == conts[i],
                    }
                )
                print(
                    f"  check problem {i} W={W} L={L}: engine {r.steps} steps, "
                    f"replay {len(replayed)} steps, same tokens {r.tokens == conts[i]}"
                )
    header = "mode".ljust(24) + "".join(f"L={n}".rjust(8) for n in lengths)
    for mode in modes:
        print(f"\n{header}")
        for W in widths:
            row = "".join(f"{table[mode][f'W={W},L={n}']:8.2f}" for n in lengths)
            print(f"{mode[:18]:18s} W={W:<3d}{row}")
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "args": vars(args),
            "tokens_per_step": table,
            "engine_check": check,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
