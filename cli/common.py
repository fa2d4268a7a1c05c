"""What the commands share: option types, one-line errors, progress bars, model resolution."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

err = Console(stderr=True, highlight=False)

# Option types shared by the commands (flag names follow mlx-lm's CLI).
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="Registry name or mlx-lm folder (default: the demo model)."),
]
DrafterOpt = Annotated[
    Path | None, typer.Option("--drafter", help="Drafter folder (default: the model's own).")
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-m", help="Tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Sampling temperature (0: greedy).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold (0: off).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Sample among the k most likely (0: off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling threshold (0: off).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed for sampling.")]
WidthOpt = Annotated[
    int | None, typer.Option("--beam-width", help="Beams drafted per step, W (model default).")
]
LengthOpt = Annotated[
    int | None,
    typer.Option("--beam-length", help="Tokens per beam incl. the sure one, L (model default)."),
]
PruneOpt = Annotated[
    bool | None,
    typer.Option(
        "--prune/--no-prune",
        help="Verify only the tree nodes worth their cost here (default: as `tune` found).",
        show_default=False,
    ),
]
LookupOpt = Annotated[
    int,
    typer.Option(
        "--lookup",
        help="Prompt lookup: when the last N or more tokens (up to 6) occurred earlier in the "
        "conversation, verify what followed them in place of the drafter's last beam (0: off).",
    ),
]
NoDraftOpt = Annotated[bool, typer.Option("--no-draft", help="Plain mlx-lm decoding instead.")]
FullHeadOpt = Annotated[
    bool,
    typer.Option(
        "--full-head",
        help="Take greedy targets and top-p draws from the float32 LM head, not its int8 screen "
        "(Linux x86-64 only): saves the screen's memory, a quarter of the head's (168 MB for "
        "Gemma 3 270M), at some speed. Same output either way.",
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show tracebacks on errors.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")]


@contextlib.contextmanager
def user_errors(verbose: bool = False) -> Iterator[None]:
    """Turn a user mistake into one clear line and exit status 1 (a traceback with --verbose)."""
    try:
        yield
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        if verbose:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        err.print(f"[red]error:[/red] {message}", soft_wrap=True)
        raise typer.Exit(1) from None


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator:
    """A rich progress bar; yields a ``progress(done, total, name)`` callback.

    The bar appears on the first callback, so work that turns out to be cached (a model
    already fetched) prints nothing."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("[dim]{task.fields[item]}"),
    )
    with Progress(*columns, console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task(description, total=None, item="", visible=False)

        def update(done: int, total: int, item: str = "") -> None:
            bar.update(task, completed=done, total=total, item=item, visible=True)

        yield update


def resolve(model: str | None, drafter: Path | None, no_draft: bool):
    """Model folder, drafter folder (None with --no-draft) and the registry entry, if any."""
    from redrafter_mlx import registry

    with progress_bar("fetching model") as progress:
        model_dir, entry = registry.resolve_model(model, progress=progress)
    if no_draft:
        return model_dir, None, entry
    if drafter is None:
        drafter = entry.drafter_dir if entry is not None else None
        if drafter is None:
            what = entry.name if entry is not None else model_dir
            raise FileNotFoundError(
                f"no trained drafter for {what}: pass --drafter DIR "
                "(train one with `redrafter train`) or --no-draft"
            )
    return model_dir, drafter, entry


def defaults(model_dir, drafter_dir, entry, beam_width, beam_length) -> tuple[int, int]:
    """Flags first, then what `tune` stored for this machine, drafter and BLAS, then the
    registry entry (saying so when a stored tune no longer applies)."""
    from redrafter_mlx import settings

    tuned, stale = settings.tuned_beam(model_dir, drafter_dir)
    if stale and not (beam_width and beam_length):
        err.print(f"[yellow]{stale}: not using it; run `redrafter tune` again[/yellow]")
    W = beam_width or tuned.get("width") or (entry.beam_width if entry else 4)
    L = beam_length or tuned.get("length") or (entry.beam_length if entry else 5)
    return W, L


def tree_budget(model_dir, drafter_dir, llm, drafter, W: int, L: int, prune: bool | None):
    """The TreeBudget to generate with, or None (no pruning).

    ``prune`` None (no flag): prune when `tune` found it fastest for this model, shape,
    drafter and BLAS on this machine, with the step cost and calibration it measured. True: that
    stored cost if there is one, else the cost measured now (~1-2 s). False: never.
    """
    from redrafter_mlx import settings
    from redrafter_mlx.generate import step_cost
    from redrafter_mlx.tree_budget import TreeBudget

    if prune is False or drafter is None:
        return None
    tuned, _ = settings.tuned_beam(model_dir, drafter_dir)
    same = (tuned.get("width"), tuned.get("length")) == (W, L)
    stored = tuned.get("step_cost") if same else None  # only there when tune chose pruning
    if stored:
        return TreeBudget(stored, alpha=tuned.get("alpha", 1.0))
    if prune:
        return TreeBudget(step_cost(llm, drafter, W, L))
    return None


def read_prompt(prompt: str) -> str:
    return sys.stdin.read() if prompt == "-" else prompt
