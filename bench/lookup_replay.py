"""Would a prompt-lookup beam beside the drafter's add tokens/step? A greedy replay.

Prompt lookup (redrafter_mlx/prompt_lookup.py) proposes, at each step, the tokens that followed
the latest earlier occurrence of the context's last n tokens (n from --ngram down to
--min-ngram) in prompt + output so far. For HumanEval's greedy continuations (cached by
``bench/drafter_card.py``), this replays W=1 beams of the drafter (exact for greedy, see
redrafter_mlx/acceptance.py) against three policies:

- ``drafter``: the drafter's beam alone (``--lookup 0``);
- ``replace``: the lookup beam instead of the drafter's when a match exists (the engine's
  ``--lookup N``; the tree keeps its size);
- ``union``: both beams in one tree (verified nodes grow where they differ);

and prints tokens/step and verified nodes/step. Writes JSON.

    python bench/lookup_replay.py --problems 0-99 --lengths 3 --min-ngram 1,2,3
"""

from __future__ import annotations

import argparse
import types

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx import registry
from redrafter_mlx.beam_search import beam_search
from redrafter_mlx.benchmark import humaneval_prompts, machine_info, write_json
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.prompt_lookup import PromptLookup
from redrafter_mlx.verification import SamplingParams

import mlx.core as mx
import numpy as np
from drafter_card import answers, cache_file


def matched(proposal, future) -> int:
    a = 0
    for x, y in zip(proposal, future, strict=False):
        if x != y:
            break
        a += 1
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None, help="default: the model's shipped drafter")
    ap.add_argument("--problems", default="0-99")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lengths", default="3,4")
    ap.add_argument("--ngram", type=int, default=3, help="the longest n-gram matched")
    ap.add_argument("--min-ngram", default="1,2,3", help="shortest n-grams to try, each")
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--out", default="bench/results/lookup_replay.json")
    args = ap.parse_args()
    model_dir, entry = registry.resolve_model(args.model)
    drafter_dir = args.drafter or (entry.drafter_dir if entry else None)
    if drafter_dir is None:
        ap.error("--model is a folder: pass --drafter too")
    model, tokenizer, drafter = load(model_dir, drafter_dir)
    embed = TreeLLM(model).embed
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.problems)]
    key = types.SimpleNamespace(**vars(args), no_cache=False)
    conts, hidden = answers(
        model,
        prompts,
        args.max_tokens,
        set(tokenizer.eos_token_ids),
        SamplingParams(),
        args.batch,
        cache_file(model_dir, key, "greedy"),
    )
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for min_ngram in (int(x) for x in args.min_ngram.split(",")):
            tally = {p: [0, 0, 0] for p in ("drafter", "union", "replace")}  # steps, tok, nodes
            for prompt, c, h in zip(prompts, conts, hidden, strict=True):
                drafts: dict[int, list[int]] = {}  # by root position: policies share them
                for policy, t in tally.items():
                    p = 0
                    context = PromptLookup(prompt + c[:1], length - 1, args.ngram, min_ngram)
                    while p < len(c) - 1:
                        if p not in drafts:
                            state = mx.array(h[p][None].astype(np.float32))
                            root = mx.array([c[p]])
                            beams = beam_search(drafter, embed, state, root, 1, length).tokens
                            drafts[p] = np.array(beams)[0, 0, 1:].tolist()
                        draft = drafts[p]
                        future = c[p + 1 : p + length]
                        found = context.propose() if policy != "drafter" else None
                        a, nodes = matched(draft, future), length
                        if policy == "union" and found:
                            a = max(a, matched(found, future))
                            nodes += len(found) - matched(found, draft)
                        elif policy == "replace" and found:
                            a = matched(found, future)
                        a = min(a, len(c) - 2 - p)
                        t[0] += 1
                        t[1] += a + 1
                        t[2] += nodes
                        context.extend(c[p + 1 : p + a + 2])
                        p += a + 1
            for policy, (steps, toks, nodes) in tally.items():
                row = {
                    "length": length,
                    "min_ngram": min_ngram,
                    "policy": policy,
                    "tokens_per_step": toks / steps,
                    "nodes_per_step": nodes / steps,
                }
                rows.append(row)
                print(
                    f"L={length} min n-gram {min_ngram} {policy:8s}: "
                    f"{row['tokens_per_step']:.3f} tokens/step, "
                    f"{row['nodes_per_step']:.2f} verified nodes/step",
                    flush=True,
                )
    write_json(args.out, {"args": vars(args), "machine": machine_info(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
