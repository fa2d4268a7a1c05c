"""The ``redrafter`` command line: thin commands over the library."""

from __future__ import annotations

import redrafter_mlx  # noqa: F401  (loads MKL or OpenBLAS before anything imports mlx)

import typer

from . import bench, chat, convert, generate, models, train

app = typer.Typer(
    help="ReDrafter speculative decoding for LLMs on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(chat.chat)
app.command()(generate.generate)
app.command()(models.fetch)
app.command()(models.models)
app.command()(bench.bench)
app.command()(bench.tune)
app.command()(train.train)
app.add_typer(convert.app, name="convert")


if __name__ == "__main__":
    app()
