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

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx import generate
from redrafter_mlx.benchmark import load_prompts
from redrafter_mlx.drafter import Drafter
from redrafter_mlx.loading import load

import mlx.core as mx
from paired import in_pairs, report, shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a registered model (default: the demo)")
    ap.add_argument("--prompts", default="humaneval:0,15,7")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results/drafter_dtype.json")
    args = ap.parse_args()

    model_dir, entry = shipped(ap, args.model)
    model, tokenizer, kept = load(model_dir, entry.drafter_dir, cast_drafter=False)
    cast = Drafter.from_pretrained(entry.drafter_dir)
    cast.set_dtype(mx.float32)
    print(f"stored drafter dtype: {kept.dtype}", flush=True)
    kw = dict(
        beam_width=entry.beam_width,
        beam_length=entry.beam_length,
        max_tokens=args.max_tokens,
        stop_tokens=set(tokenizer.eos_token_ids),
    )
    decoders = {
        name: (lambda ids, d=drafter: generate.stream_generate(model, d, ids, **kw))
        for name, drafter in (("cast", cast), ("kept", kept))
    }
    prompts = load_prompts(args.prompts, tokenizer)
    rows = in_pairs(prompts, decoders, args.pairs, f"{kept.dtype} kept vs float32 cast")
    for row in rows:
        row["kept_dtype"] = str(kept.dtype)
    report(rows, args, f"kept vs cast on {args.prompts}")


if __name__ == "__main__":
    main()
