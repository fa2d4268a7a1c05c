"""The decoding loop at a git revision against the working tree's, in pairs on the same prompts.

On a machine whose speed drifts by 5-20% within minutes (the 2-core VM this was written on),
two whole bench runs differ by more than a change worth a few percent. Pairs do not: each
prompt is decoded by both engines back to back, their order alternating, and each pair is
compared on its own. An A/A run (``--against HEAD`` on an unchanged tree) shows the floor:
there 0.93-1.07x per prompt with 2-4 pairs, so a change of a few percent needs many pairs.

``--against REV`` loads ``redrafter_mlx/generate.py`` as it was at REV (everything else from
the working tree, so REV's loop must still fit today's modules) beside the working tree's,
then per prompt prints both medians of generation tokens/s and tokens per step, the ratio, and
how many pairs the working tree won; greedy outputs must be identical. Writes JSON.

    python bench/paired.py --against HEAD~1 --prompts humaneval:0,15,7 --pairs 4
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx import generate, registry
from redrafter_mlx.benchmark import consume, load_prompts, machine_info, write_json
from redrafter_mlx.loading import load

REPO = Path(__file__).resolve().parent.parent


def loop_at(rev: str, workdir: Path) -> ModuleType:
    """``redrafter_mlx.generate`` as it was at git revision ``rev``."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:redrafter_mlx/generate.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except subprocess.CalledProcessError as e:
        msg = f"cannot read redrafter_mlx/generate.py at {rev!r}: {e.stderr.strip()}"
        raise SystemExit(msg) from None
    path = workdir / "generate_at_rev.py"
    path.write_text(source)
    # A name inside the package, so the file's relative imports find the working tree's modules.
    spec = importlib.util.spec_from_file_location("redrafter_mlx._generate_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="git revision of the other loop")
    ap.add_argument("--model", default=None, help="a registered model (default: the demo)")
    ap.add_argument("--prompts", default="humaneval:0,15,7")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--length", type=int, default=3)
    ap.add_argument("--lookup", type=int, default=2)
    ap.add_argument("--out", default="bench/results/paired.json")
    args = ap.parse_args()

    model_dir, entry = shipped(ap, args.model)
    model, tokenizer, drafter = load(model_dir, entry.drafter_dir)
    prompts = load_prompts(args.prompts, tokenizer)
    kw = dict(
        beam_width=args.width,
        beam_length=args.length,
        lookup=args.lookup,
        max_tokens=args.max_tokens,
        stop_tokens=set(tokenizer.eos_token_ids),
    )
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"rev": loop_at(args.against, Path(tmp)), "tree": generate}
        decoders = {
            name: (lambda ids, e=engine: e.stream_generate(model, drafter, ids, **kw))
            for name, engine in engines.items()
        }
        rows = in_pairs(prompts, decoders, args.pairs, f"{args.against} vs working tree")
    report(rows, args, f"working tree vs {args.against} on {args.prompts}")


def shipped(ap: argparse.ArgumentParser, model: str | None) -> tuple[Path, registry.ModelEntry]:
    """A registered model's folder and entry (default: the demo); an argparse error if it has
    no shipped drafter."""
    model_dir, entry = registry.resolve_model(model)
    if entry is None or entry.drafter_dir is None:
        ap.error(f"{model} has no shipped drafter")
    return model_dir, entry


def in_pairs(
    prompts: list[list[int]],
    decoders: dict[str, Callable[[list[int]], Iterator]],
    pairs: int,
    label: str,
) -> list[dict]:
    """Two decoders (``{name: ids -> stream}``, the first the reference) on each prompt,
    ``pairs`` runs each, their order alternating; one row per prompt, printed as it ends: both
    medians of tokens/s and tokens per step, the ratio (second over first), how many pairs the
    second won, and whether every run gave the first run's tokens."""
    a, b = decoders
    rows = []
    for i, ids in enumerate(prompts):
        runs: dict[str, list] = {a: [], b: []}
        for p in range(pairs):
            for name in (a, b) if p % 2 == 0 else (b, a):
                runs[name].append(consume(name, i, decoders[name](ids)))
        tps = {k: [r.generation_tps for r in v] for k, v in runs.items()}
        row = {
            "prompt": i,
            f"{a}_tps": statistics.median(tps[a]),
            f"{b}_tps": statistics.median(tps[b]),
            f"{a}_tokens_per_step": statistics.median(r.tokens_per_step for r in runs[a]),
            f"{b}_tokens_per_step": statistics.median(r.tokens_per_step for r in runs[b]),
            f"{b}_won": sum(y > x for x, y in zip(tps[a], tps[b], strict=True)),
            "identical": all(r.tokens == runs[a][0].tokens for r in runs[a] + runs[b]),
        }
        row["ratio"] = row[f"{b}_tps"] / row[f"{a}_tps"]
        rows.append(row)
        print(
            f"prompt #{i} ({label}): {a} {row[f'{a}_tps']:.2f} tokens/s "
            f"({row[f'{a}_tokens_per_step']:.2f}/step), {b} {row[f'{b}_tps']:.2f} "
            f"({row[f'{b}_tokens_per_step']:.2f}/step): {row['ratio']:.3f}x, won "
            f"{row[f'{b}_won']}/{pairs}, identical {row['identical']}",
            flush=True,
        )
    return rows


def report(rows: list[dict], args: argparse.Namespace, label: str) -> None:
    """Print the machine and the median ratio over prompts with the pairs won; write JSON."""
    info = machine_info()
    won = sum(v for r in rows for k, v in r.items() if k.endswith("_won"))
    median = statistics.median(r["ratio"] for r in rows)
    print(f"machine: {info}")
    print(f"{label}: median ratio {median:.3f}x, {won}/{args.pairs * len(rows)} pairs won")
    write_json(args.out, {"machine": info, "args": vars(args), "rows": rows, "median": median})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
