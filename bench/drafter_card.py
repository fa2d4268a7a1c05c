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
import hashlib
import json
import time
from pathlib import Path

from redrafter_mlx import paths, registry
from redrafter_mlx.acceptance import replay, tokens_per_step
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.benchmark import consume, humaneval_prompts, machine_info, write_json
from redrafter_mlx.distill_data import greedy_with_hidden
from redrafter_mlx.generate import stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.recipe import lineage
from redrafter_mlx.verification import SamplingParams

import mlx.core as mx
import numpy as np


def answers(model, prompts, max_tokens, stop, sampling, batch, cache: Path | None):
    """The LLM's answers and hidden states, cached on disk: they do not depend on the drafter,
    so measuring another drafter (or checkpoint) of the same LLM costs only the replays."""
    if cache is not None and cache.is_file():
        stored = mx.load(str(cache))
        n = len(prompts)
        conts = [np.array(stored[f"tokens.{i}"]).tolist() for i in range(n)]
        return conts, [np.array(stored[f"hidden.{i}"]) for i in range(n)]
    conts, hidden = [], []
    for s in range(0, len(prompts), batch):
        for a, h in greedy_with_hidden(model, prompts[s : s + batch], max_tokens, stop, sampling):
            conts.append(a)
            hidden.append(h)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"tokens.{i}": mx.array(np.array(c, np.int32)) for i, c in enumerate(conts)}
        arrays |= {f"hidden.{i}": mx.array(h) for i, h in enumerate(hidden)}
        mx.save_safetensors(str(cache), arrays)
    return conts, hidden


def cache_file(model_dir: Path, args, mode: str) -> Path | None:
    if args.no_cache:
        return None
    # Sampled answers depend on the batch too (one random stream per batch).
    key = json.dumps(
        [str(Path(model_dir).resolve()), args.problems, args.max_tokens, mode, args.batch]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return paths.cache_dir() / "card-answers" / f"{digest}.safetensors"


def train_command(report: dict, out: str = "DRAFTER_DIR", init: str | None = None) -> str:
    """The `redrafter train` line that reproduces one stage of ``report.json`` into ``out``,
    continuing the drafter at ``init`` for a stage trained with ``--init-drafter``."""
    r, t = report["recipe"], report["recipe"]["train"]
    flags = {
        "--num-prompts": r["num_prompts"],
        "--held-out": r["held_out"],
        "--max-new-tokens": r["max_new_tokens"],
        "--gen-batch": r["gen_batch"],
        "--draft-vocab": r["draft_vocab"] or 0,
        "--horizons": t["horizons"],
        "--window": t["window"],
        "--batch-rows": t["batch_rows"],
        "--max-steps": t["steps"],
        "--lr": t["lr"],
        "--warmup": t["warmup"],
        "--grad-clip": t["grad_clip"] or 0,
        "--kl-weight": t["kl_weight"],
        "--head-init": t.get("head_init", "random"),
        "--seed": t["seed"],
    }
    if r.get("init_drafter"):  # the vocabulary and the head come from the drafter continued
        del flags["--draft-vocab"], flags["--head-init"]
        flags["--init-drafter"] = init or "INIT_DRAFTER_DIR"
    if r.get("final_vocab"):
        flags["--final-vocab"] = r["final_vocab"]
    args = " ".join(f"{k} {v}" for k, v in flags.items())
    if r.get("chat_share", 0.5) == 0:
        args += " --completions-only"
    if r.get("fresh_prompts"):
        args += " --fresh-prompts"
    return f"redrafter train --out {out} {args}"


def stage_lines(report: dict) -> list[str]:
    """How one stage was trained, from its ``report.json``."""
    r, t = report["recipe"], report["recipe"]["train"]
    acc = ", ".join(f"{a:.3f}" for a in report["heldout_accuracy_by_horizon"])
    answers = report["data"].get("answers", r["num_prompts"])
    kind = "raw completions only" if r.get("chat_share", 0.5) == 0 else "half as chat requests"
    fresh = ", none used by an earlier stage" if r.get("fresh_prompts") else ""
    return [
        f"- Data: {answers} prompts from the Python standard library ({kind}{fresh}; "
        f"seed {t['seed']}; {r['held_out']} held out), answered greedily by the LLM, at most "
        f"{r['max_new_tokens']} new tokens: {report['data']['tokens']} answer tokens.",
        f"- Draft vocabulary: {report['draft_vocab_size']} tokens, covering "
        f"{report['draft_vocab_coverage_train']:.1%} of training and "
        f"{report['draft_vocab_coverage_heldout']:.1%} of held-out answer tokens.",
        f"- Training: {report['train_steps']} steps of {t['batch_rows']} rows x {t['window']} "
        f"positions, K={t['horizons']} horizons, AdamW lr {t['lr']} (warmup {t['warmup']}, "
        f"cosine), grad clip {t['grad_clip']}, "
        + (
            "from the previous stage's weights; "
            if r.get("init_drafter")
            else f"head init {t.get('head_init', 'random')}; "
        )
        + f"{report['train_seconds'] / 60:.0f} min, "
        f"{report['train_tokens_per_s']:.0f} positions/s.",
        f"- Held-out top-1 accuracy by horizon: {acc}; held-out tokens/step through the "
        f"engine (W={r['eval_width']}, L={r['eval_length']}, {r['eval_tokens']} tokens): "
        f"{report['heldout_tokens_per_step']:.2f}.",
    ]


def card_markdown(report: dict, table: dict, problems: str, max_tokens: int, info: dict) -> str:
    """The drafter card: how it was trained (from ``report.json``, every stage of it) and
    what it accepts."""
    stages = lineage(report)
    lines = [
        "# Drafter card",
        "",
        f"Trained and measured with `redrafter train` and `bench/drafter_card.py` on "
        f"{info['chip']}, {info['cpu_count']} cores ({info['platform']}; mlx {info['mlx']}, "
        f"mlx-lm {info['mlx_lm']}, {info['device']}).",
        "",
    ]
    for i, stage in enumerate(stages, 1):
        if len(stages) > 1:
            how = f"continues stage {i - 1}" if i > 1 else "a new drafter"
            lines += [f"Stage {i} ({how}):", ""]
        lines += [*stage_lines(stage), ""]
    lines += [
        "Reproduce (the data step is cached in the work folder; `--resume` continues):",
        "",
        "```bash",
    ]
    for i, stage in enumerate(stages, 1):
        out = "DRAFTER_DIR" if len(stages) == 1 else f"DRAFTER_{i}"
        lines.append(train_command(stage, out, init=f"DRAFTER_{i - 1}"))
    lines += [
        "```",
        "",
        f"Tokens per step on HumanEval problems {problems}, {max_tokens} new tokens "
        "(replayed: exact for greedy, see `redrafter_mlx/acceptance.py`):",
        "",
    ]
    for mode, cells in table.items():
        keys = list(cells)
        lengths = sorted({k.split("L=")[1] for k in keys}, key=int)
        widths = sorted({k.split(",")[0][2:] for k in keys}, key=int)
        lines += [f"| {mode} | " + " | ".join(f"L={n}" for n in lengths) + " |"]
        lines += ["|---" * (len(lengths) + 1) + "|"]
        for w in widths:
            row = " | ".join(f"{cells[f'W={w},L={n}']:.2f}" for n in lengths)
            lines += [f"| W={w} | {row} |"]
        lines += [""]
    return "\n".join(lines)


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
    ap.add_argument("--no-cache", action="store_true", help="regenerate the LLM's answers")
    ap.add_argument(
        "--card",
        default=None,
        help="write the markdown card here (needs the "
        "drafter's report.json from `redrafter train`)",
    )
    ap.add_argument(
        "--from-result",
        default=None,
        help="write --card from this earlier --out JSON instead of measuring again",
    )
    args = ap.parse_args()
    if args.from_result:
        if not args.card:
            ap.error("--from-result writes a card: pass --card too")
        saved = json.loads(Path(args.from_result).read_text())
        write_card(
            args.card, args.drafter, saved["tokens_per_step"], saved["args"], saved["machine"]
        )
        return

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
        cache = cache_file(model_dir, args, mode)
        conts, hidden = answers(model, prompts, args.max_tokens, stop, sampling, args.batch, cache)
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
    if args.card:
        write_card(args.card, args.drafter, table, vars(args), machine_info())


def write_card(card: str, drafter: str, table: dict, args: dict, info: dict) -> None:
    report = json.loads((Path(drafter) / "report.json").read_text())
    text = card_markdown(report, table, args["problems"], args["max_tokens"], info)
    Path(card).write_text(text)
    print(f"wrote {card}")


if __name__ == "__main__":
    main()
