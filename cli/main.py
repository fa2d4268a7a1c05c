"""The ``redrafter`` command line: thin commands over the library."""

from __future__ import annotations

import redrafter_mlx  # noqa: F401  (loads OpenBLAS before anything imports mlx)

import typer

from . import convert, generate, models, train

app = typer.Typer(
    help="ReDrafter speculative decoding for LLMs on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(generate.generate)
app.command()(models.fetch)
app.command()(models.models)
app.command()(train.train)
app.add_typer(convert.app, name="convert")


if __name__ == "__main__":
    app()
