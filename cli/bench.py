"""``redrafter bench`` and ``redrafter tune``: ReDrafter against mlx-lm's AR, same process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .common import (
    DrafterOpt,
    LengthOpt,
    LookupOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    SeedOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    WidthOpt,
    defaults,
    err,
    resolve,
    user_errors,
)

PromptsOpt = Annotated[
    str,
    typer.Option("--prompts", help="humaneval:0-99, an MT-Bench-style .jsonl, or a text file."),
]


def parse_grid(grid: str) -> list[tuple[int, int]]:
    """``1,2,4x3,4,5`` -> every (W, L) pair."""
    try:
        widths, lengths = grid.split("x")
        pairs = [(int(w), int(n)) for w in widths.split(",") for n in lengths.split(",")]
    except ValueError:
        raise ValueError(f"--grid {grid!r}: expected widths x lengths, like 1,2,4x3,4,5") from None
    bad = [p for p in pairs if p[0] < 1 or p[1] < 2]
    if bad:
        raise ValueError(f"--grid: widths must be >= 1 and lengths >= 2, got {bad}")
    return pairs


def parse_lookups(lookup: str) -> list[int]:
    """``0,2`` -> [0, 2]: prompt lookup's shortest n-grams to run each config with (0: off)."""
    try:
        sizes = [int(n) for n in lookup.split(",")]
    except ValueError:
        raise ValueError(f"--lookup {lookup!r}: expected n-gram sizes like 2 or 0,2") from None
    if any(n < 0 for n in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--lookup {lookup!r}: sizes must be distinct and >= 0 (0: off)")
    return sizes


def run_name(W: int, L: int, pruned: bool = False, lookup: int = 0) -> str:
    return (
        f"ReDrafter W={W} L={L}"
        + (" pruned" if pruned else "")
        + (f" lookup {lookup}" if lookup else "")
    )


def run_bench(
    model,
    drafter,
    prompts,
    configs,
    sampling,
    max_tokens,
    stop,
    seed,
    profile,
    log,
    prune=False,
    lookups=(0,),
    full_head=False,
) -> tuple[dict, list]:
    """AR and every (W, L) config on every prompt, alternating; returns summary and runs.

    ``prune`` adds a pruned run of each config, with the step cost measured here first;
    each config runs once per prompt-lookup size in ``lookups``; ``full_head`` adds a run of
    each unpruned config with its targets (greedy, or top-p draws) from the float32 head instead
    of its int8 screen (where the screen applies).
    """
    from redrafter_mlx.benchmark import compare, summarize
    from redrafter_mlx.generate import step_cost, stream_autoregressive, stream_generate
    from redrafter_mlx.nucleus_screen import ScreenedNucleus
    from redrafter_mlx.tree_budget import TreeBudget

    import mlx.core as mx

    kw = dict(max_tokens=max_tokens, sampling=sampling, stop_tokens=stop)

    def seeded(stream_fn):
        def run(ids):
            if seed is not None:
                mx.random.seed(seed)
            return stream_fn(ids)

        return run

    def as_shipped(steps):
        """A run's steps, then the drafter back in its shipped dtype: a float search (W >= 2,
        a budget) casts it in place, and the runs after it (W = 1's int8 drafts, AR) would
        otherwise hold that cast and count it in their peaks. Casting back is exact: the cast
        widened it."""
        dtype = drafter.dtype
        try:
            yield from steps()
        finally:
            if drafter.dtype != dtype:
                drafter.set_dtype(dtype)
                mx.eval(drafter.parameters())  # frees the cast before the next run

    def redrafter(W: int, L: int, lookup: int, budget: TreeBudget | None = None, head=True):
        return seeded(
            lambda ids: as_shipped(
                lambda: stream_generate(
                    model,
                    drafter,
                    ids,
                    beam_width=W,
                    beam_length=L,
                    profile=profile,
                    budget=budget,
                    lookup=lookup,
                    head_screen=head,
                    **kw,
                )
            )
        )

    runners = {"AR (mlx-lm)": seeded(lambda ids: stream_autoregressive(model, ids, **kw))}
    budgets = {}
    for W, L in configs:
        for n in lookups:
            runners[run_name(W, L, False, n)] = redrafter(W, L, n)
            if full_head and (sampling.greedy or ScreenedNucleus.takes(sampling)):
                runners[run_name(W, L, False, n) + " full head"] = redrafter(W, L, n, head=False)
        if not prune:
            continue
        cost = step_cost(model, drafter, W, L)
        ratios = " ".join(f"{c / cost[0]:.2f}" for c in cost)
        log(f"[dim]W={W} L={L}: step cost for 1..{len(cost)} tokens, x one: {ratios}[/dim]")
        for n in lookups:
            budget = budgets[run_name(W, L, True, n)] = TreeBudget(cost)  # calibrated as in chat
            runners[run_name(W, L, True, n)] = redrafter(W, L, n, budget)

    def on_result(r) -> None:
        log(
            f"[dim]prompt {r.prompt_index}: {r.name}: {r.generation_tps:.2f} tokens/s, "
            f"{r.tokens_per_step:.2f} tokens/step[/dim]"
        )

    results = compare(prompts, runners, on_result=on_result)
    summary = summarize(results, baseline="AR (mlx-lm)")
    for name, budget in budgets.items():
        log(f"[dim]{name}: calibration alpha {budget.alpha:.2f} at the end[/dim]")
        row = summary[name]
        row["step_cost"], row["alpha"] = list(budget.step_cost), budget.alpha
    return summary, results


def table_console() -> Console:
    """Rich assumes 80 columns when stdout is not a terminal, which elides the table's cells;
    piped or logged, the table gets the width it needs instead."""
    console = Console()
    if not console.is_terminal:
        console.width = 160
    return console


def render(summary: dict, info: dict, title: str, greedy: bool) -> Table:
    table = Table(
        title=title,
        caption=f"{info['chip']} · {info['platform']} · mlx "
        f"{info['mlx']} · mlx-lm {info['mlx_lm']} · {info['device']} · {info['blas']}",
    )
    table.add_column("", no_wrap=True)
    columns = ("tokens/s", "speedup", "tokens/step", "verified", "accepted ≥1/≥2/≥3", "lookup")
    for col in (*columns, "peak GB"):
        table.add_column(col, justify="right")
    if greedy:
        table.add_column("identical", justify="right")
    for name, row in summary.items():
        acc = "/".join(f"{a:.0%}" for a in row["acceptance_by_depth"][:3]) or "-"
        cells = [
            name,
            f"{row['generation_tps']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{row['tokens_per_step']:.2f}",
            f"{row['tree_tokens']:.1f}",
            acc,
            f"{row['lookup_share']:.0%}" if "lookup" in name else "-",
            f"{row['peak_memory_gb']:.2f}",
        ]
        if greedy:
            cells.append(f"{row['identical_to_baseline']}/{row['prompts']}")
        table.add_row(*cells)
    return table


def require_matplotlib():
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--png needs matplotlib: pip install 'redrafter-mlx[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heat_map(
    summary: dict, configs: list[tuple[int, int]], path: Path, title: str, lookup: int = 0
) -> None:
    plt = require_matplotlib()
    widths = sorted({w for w, _ in configs})
    lengths = sorted({n for _, n in configs})
    grid = [[summary[run_name(w, n, False, lookup)]["speedup"] for n in lengths] for w in widths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.9 * len(widths) + 1.5))
    im = ax.imshow(grid, cmap="viridis", origin="lower")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(widths)), [str(w) for w in widths])
    ax.set_xlabel("beam length L")
    ax.set_ylabel("beam width W")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}x", ha="center", va="center", color="w")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="speedup over AR")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench(
    model: ModelOpt = None,
    drafter: DrafterOpt = None,
    prompts: PromptsOpt = "humaneval:0-9",
    max_tokens: MaxTokensOpt = 128,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    beam_width: WidthOpt = None,
    beam_length: LengthOpt = None,
    grid: Annotated[
        str | None, typer.Option("--grid", help="Sweep W x L, e.g. 1,2,4x3,4,5,6.")
    ] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Heat map of a --grid sweep.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write everything as JSON.")] = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Time each phase of a step: tree, verify, accept, draft, commit (adds a sync "
            "after each; without it a step syncs once).",
        ),
    ] = False,
    prune: Annotated[
        bool,
        typer.Option("--prune", help="Also run each config pruned to the nodes worth their cost."),
    ] = False,
    lookup: Annotated[
        str,
        typer.Option(
            "--lookup",
            help="Prompt lookup's shortest n-grams to run each config with, e.g. 0,2 (0: off; "
            "chat and generate use 2).",
        ),
    ] = "2",
    full_head: Annotated[
        bool,
        typer.Option(
            "--full-head",
            help="Greedy or top-p sampling: also run each config with its targets from the "
            "float32 LM head instead of the int8 screen (to see what the screen gains).",
        ),
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Measure ReDrafter against mlx-lm's autoregressive decoding on the same prompts."""
    with user_errors(verbose):
        from redrafter_mlx import settings
        from redrafter_mlx.benchmark import load_prompts, machine_info, write_json
        from redrafter_mlx.loading import load
        from redrafter_mlx.verification import SamplingParams

        model_dir, drafter_dir, entry = resolve(model, drafter, no_draft=False)
        if png is not None and grid is None:
            raise ValueError("--png draws a --grid sweep; pass --grid too")
        if png is not None:
            require_matplotlib()
        lookups = parse_lookups(lookup)
        configs = (
            parse_grid(grid)
            if grid
            else [defaults(model_dir, drafter_dir, entry, beam_width, beam_length)]
        )
        llm, tokenizer, draft_model = load(model_dir, drafter_dir, cast_drafter=False)
        ids = load_prompts(prompts, tokenizer)
        sampling = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        info = machine_info()
        err.print(
            f"[bold]bench[/bold] {model_dir.name}: {len(ids)} prompts x {max_tokens} "
            f"tokens, {len(configs)} config(s), warm-up first"
        )
        summary, runs = run_bench(
            llm,
            draft_model,
            ids,
            configs,
            sampling,
            max_tokens,
            tokenizer.eos_token_ids,
            seed,
            profile,
            err.print,
            prune,
            lookups,
            full_head,
        )
        settings.put(model_dir, "ar_tokens_per_s", summary["AR (mlx-lm)"]["generation_tps"])
        mode = "greedy" if sampling.greedy else f"temp {temp}, top-p {top_p}"
        source = prompts if prompts.startswith("humaneval:") else Path(prompts).name
        title = f"{model_dir.name} · {source} · {max_tokens} tokens · {mode}"
        table_console().print(render(summary, info, title, sampling.greedy))
        if sampling.greedy:
            bad = {
                k: v["mismatched_prompts"] for k, v in summary.items() if v["mismatched_prompts"]
            }
            if bad:
                err.print(f"[red]greedy outputs differ from AR on prompts {bad}[/red]")
        if profile:
            for name, row in summary.items():
                if row["phase_ms"]:
                    phases = ", ".join(f"{k} {v:.1f}" for k, v in row["phase_ms"].items())
                    err.print(
                        f"{name}: ms per step: {phases} (total {row['step_ms']:.1f}; "
                        "a sync after each phase while profiled, one a step otherwise)",
                        soft_wrap=True,  # one line per run, for logs and greps
                    )
        if png is not None:
            heat_map(summary, configs, png, title, lookups[0])
            err.print(f"wrote {png}")
        if out is not None:
            write_json(
                out,
                {
                    "machine": info,
                    "model": str(model_dir),
                    "drafter": str(drafter_dir),
                    "prompts": prompts,
                    "max_tokens": max_tokens,
                    "lookup": lookups,
                    "sampling": sampling,
                    "summary": summary,
                    "runs": runs,
                },
            )
            err.print(f"wrote {out}")


def tune(
    model: ModelOpt = None,
    drafter: DrafterOpt = None,
    prompts: PromptsOpt = "humaneval:0-4",
    max_tokens: MaxTokensOpt = 64,
    grid: Annotated[str, typer.Option("--grid", help="W x L candidates.")] = "1,2,4x3,4,5,6",
    prune: Annotated[
        bool, typer.Option("--prune/--no-prune", help="Also try each shape pruned.")
    ] = True,
    lookup: LookupOpt = 2,
    verbose: VerboseOpt = False,
) -> None:
    """Find the fastest beam shape (W, L), pruned or not, for this model on this machine and
    keep it (with the step cost measured for pruning) as the default of chat and generate."""
    with user_errors(verbose):
        from redrafter_mlx import settings
        from redrafter_mlx.benchmark import load_prompts, machine_info
        from redrafter_mlx.loading import load
        from redrafter_mlx.verification import SamplingParams

        model_dir, drafter_dir, entry = resolve(model, drafter, no_draft=False)
        configs = parse_grid(grid)
        llm, tokenizer, draft_model = load(model_dir, drafter_dir, cast_drafter=False)
        ids = load_prompts(prompts, tokenizer)
        summary, _ = run_bench(
            llm,
            draft_model,
            ids,
            configs,
            SamplingParams(),
            max_tokens,
            tokenizer.eos_token_ids,
            None,
            False,
            err.print,
            prune=prune,
            lookups=(lookup,),
        )
        candidates = [
            (W, L, pruned) for W, L in configs for pruned in ((False, True) if prune else (False,))
        ]

        def name(W: int, L: int, pruned: bool) -> str:
            return run_name(W, L, pruned, lookup)

        best = max(candidates, key=lambda c: summary[name(*c)]["speedup"])
        row = summary[name(*best)]
        table_console().print(render(summary, machine_info(), f"tune {model_dir.name}", True))
        beam = {"width": best[0], "length": best[1], "speedup": row["speedup"]}
        beam |= {"prune": best[2], "lookup": lookup} | settings.tuned_for(drafter_dir)
        if best[2]:
            beam |= {"step_cost": row["step_cost"], "alpha": row["alpha"]}
        settings.put(model_dir, "beam", beam)
        settings.put(model_dir, "ar_tokens_per_s", summary["AR (mlx-lm)"]["generation_tps"])
        err.print(
            f"fastest: {name(*best)} ({row['speedup']:.2f}x); stored as the "
            f"default for {model_dir.name} on this machine"
        )
