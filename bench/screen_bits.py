"""Could the LM head's screen use fewer than 8 bits (half its memory at 4)?

The greedy screen (redrafter_mlx/greedy_head.py) keeps an int8 copy of the head and recounts
in float32 only the columns whose proven bound reaches the best one. Its bound is
Cauchy-Schwarz: |logit_j - screen_j| <= ||w_j - s_j q_j|| ||h|| (+ the activation's rounding
and float32 terms). For Gemma 3 270M the int8 copy of the 262144 x 640 head is 168 MB, what
keeps its ReDrafter peak above 1.15x AR's; a 4-bit copy would take 84 MB, but only if the
bound still leaves few columns to recount.

For the final hidden states of HumanEval prompts (their last ``--positions`` tokens each), this
quantizes the head per row to b bits (symmetric, one scale per row, as the int8 screen does)
and counts the columns whose bound from the weight residual alone (a lower bound on any
rigorous screen's) reaches the best column's lower bound; beside it, the same count from the
engine's own int8 screen and its full bound (without the near-tie margin the engine adds when
it recounts) where the few-row kernel runs. Prints medians, 90th
percentiles and maxima per bit width, and the bound against the actual error; writes JSON.

    python bench/screen_bits.py --model ~/.cache/redrafter-mlx/models/gemma-3-270m
"""

from __future__ import annotations

import argparse

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.adapters import adapter_for
from redrafter_mlx.benchmark import humaneval_prompts, machine_info, write_json
from redrafter_mlx.greedy_head import GreedyHead, head_weight
from redrafter_mlx.loading import load

import mlx.core as mx
import numpy as np


def hidden_states(model, tokenizer, problems: str, positions: int) -> np.ndarray:
    """[n, H] float32 final hidden states: the last ``positions`` of each prompt's prefill."""
    adapter = adapter_for(model)
    out = []
    for prompt in humaneval_prompts(problems):
        ids = mx.array(tokenizer.encode(prompt))[None]
        h = adapter.hidden_states(model, ids, None)[0, -positions:]
        out.append(np.array(h.astype(mx.float32)))
    return np.concatenate(out)


def candidates(approx: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Per row, the columns whose upper bound reaches the best column's lower bound."""
    rows = np.arange(len(approx))
    top = approx.argmax(axis=1)
    lower = approx[rows, top] - eps[rows, top]
    return (approx + eps >= lower[:, None]).sum(axis=1)


def stats(counts: np.ndarray) -> dict:
    return {
        "median": float(np.median(counts)),
        "p90": float(np.percentile(counts, 90)),
        "max": int(counts.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--problems", default="0-4")
    ap.add_argument("--positions", type=int, default=60)
    ap.add_argument("--bits", default="8,6,5,4")
    ap.add_argument("--out", default="bench/results/screen_bits.json")
    args = ap.parse_args()

    model, tokenizer, _ = load(args.model)
    weight = head_weight(model)
    if weight is None:
        raise SystemExit(f"{args.model}: the head is not a plain float32 product; no screen")
    x = hidden_states(model, tokenizer, args.problems, args.positions)
    W = np.array(weight).astype(np.float64)
    V, H = W.shape
    X = x.astype(np.float64)
    logits = X @ W.T  # [n, V]
    hn = np.linalg.norm(X, axis=1)
    top2 = np.partition(logits, -2, axis=1)[:, -2:]  # the two largest per row, in order
    info = machine_info()
    print(f"machine: {info}")
    print(
        f"head {V} x {H}; {len(X)} hidden states (||h|| median {np.median(hn):.1f}); "
        f"top-1 minus top-2 logit median {np.median(top2[:, 1] - top2[:, 0]):.3f}"
    )
    print(f"{'screen':>22s} {'MB':>6s} {'bound':>8s} {'error':>8s}  columns to recount")
    rows = []
    engine = GreedyHead.for_model(model)
    if engine is not None:
        screen, eps = engine.screen(x)
        count = candidates(screen.astype(np.float64), eps.astype(np.float64))
        err = np.abs(logits - screen)
        row = {"screen": "engine int8", "mb": engine.nbytes / 1e6, "columns": stats(count)}
        row |= {"bound_median": float(np.median(eps)), "error_median": float(np.median(err))}
        rows.append(row)
    for bits in [int(b) for b in args.bits.split(",")]:
        qmax = 2 ** (bits - 1) - 1
        amax = np.abs(W).max(axis=1)
        scale = np.where(amax > 0, amax / qmax, 1.0)
        q = np.clip(np.rint(W / scale[:, None]), -qmax, qmax)
        approx = X @ (q * scale[:, None]).T
        eps = np.linalg.norm(W - q * scale[:, None], axis=1)[None, :] * hn[:, None]
        row = {"screen": f"{bits}-bit, residual only", "mb": V * H * bits / 8e6}
        row |= {"columns": stats(candidates(approx, eps))}
        row |= {"bound_median": float(np.median(eps))}
        row |= {"error_median": float(np.median(np.abs(logits - approx)))}
        rows.append(row)
    for row in rows:
        c = row["columns"]
        print(
            f"{row['screen']:>22s} {row['mb']:6.0f} {row['bound_median']:8.3f} "
            f"{row['error_median']:8.3f}  median {c['median']:.0f}, p90 {c['p90']:.0f}, "
            f"max {c['max']} of {V}"
        )
    write_json(args.out, {"machine": info, "args": vars(args), "vocab": V, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
