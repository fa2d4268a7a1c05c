"""The shipped float16 drafter kept as it is against its float32 cast, in pairs, one process.

Where the few-row kernel runs, one-beam drafts come from int8 copies of the drafter's matrices,
which read float16 weights exactly, so ``generate``, ``chat`` and ``bench`` leave a shipped
float16 drafter uncast (``load(..., cast_drafter=False)``). This checks that it costs nothing:
for each prompt, ``--pairs`` runs of each (the order alternating), the same engine and shape,
then the ratio of median tokens/s (float16 over float32), the pairs the float16 one won, whether
the tokens matched. Writes JSON. (Peaks are not compared here, where both drafters are
resident: ``redrafter generate --json`` reports them, one process each.)

    python bench/drafter_dtype.py --prompts humaneval:0,15,7
"""

from __future__ import annotations

import argparse
import statistics

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx import generate, registry
from redrafter_mlx.benchmark import consume, load_prompts, machine_info, write_json
from redrafter_mlx.drafter import Drafter
from redrafter_mlx.loading import load

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a registered model (default: the demo)")
    ap.add_argument("--prompts", default="humaneval:0,15,7")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/drafter_dtype.json")
    args = ap.parse_args()

    model_dir, entry = registry.resolve_model(args.model)
    if entry is None or entry.drafter_dir is None:
        ap.error(f"{args.model} has no shipped drafter")
    model, tokenizer, kept = load(model_dir, entry.drafter_dir, cast_drafter=False)
    cast = Drafter.from_pretrained(entry.drafter_dir)
    cast.set_dtype(mx.float32)
    drafters = {"kept": kept, "cast": cast}
    print(f"stored drafter dtype: {kept.dtype}", flush=True)
    kw = dict(
        beam_width=entry.beam_width,
        beam_length=entry.beam_length,
        max_tokens=args.max_tokens,
        stop_tokens=set(tokenizer.eos_token_ids),
    )
    rows = []
    for i, ids in enumerate(load_prompts(args.prompts, tokenizer)):
        runs: dict[str, list] = {"kept": [], "cast": []}
        for p in range(args.pairs):
            for name in ("kept", "cast") if p % 2 == 0 else ("cast", "kept"):
                stream = generate.stream_generate(model, drafters[name], ids, **kw)
                runs[name].append(consume(name, i, stream))
        tps = {k: [r.generation_tps for r in v] for k, v in runs.items()}
        row = {
            "prompt": i,
            "kept_dtype": str(kept.dtype),
            "kept_tps": statistics.median(tps["kept"]),
            "cast_tps": statistics.median(tps["cast"]),
            "kept_won": sum(k > c for k, c in zip(tps["kept"], tps["cast"], strict=True)),
            "identical": all(r.tokens == runs["cast"][0].tokens for v in runs.values() for r in v),
        }
        row["ratio"] = row["kept_tps"] / row["cast_tps"]
        rows.append(row)
        print(
            f"prompt #{i}: kept {row['kept_tps']:.2f}, cast {row['cast_tps']:.2f} tokens/s: "
            f"{row['ratio']:.3f}x, kept won {row['kept_won']}/{args.pairs}, identical "
            f"{row['identical']}",
            flush=True,
        )
    info = machine_info()
    median = statistics.median(r["ratio"] for r in rows)
    won = sum(r["kept_won"] for r in rows)
    print(f"machine: {info}")
    print(f"kept vs cast: median ratio {median:.3f}x, {won}/{args.pairs * len(rows)} pairs won")
    write_json(args.out, {"machine": info, "args": vars(args), "rows": rows, "median": median})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
