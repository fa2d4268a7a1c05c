"""``redrafter convert drafter|llm``: PyTorch/safetensors/GGUF checkpoints -> MLX."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from .common import ForceOpt, VerboseOpt, err, progress_bar, user_errors

app = typer.Typer(help="Convert checkpoints to MLX.", no_args_is_help=True)

SrcArg = Annotated[Path, typer.Argument(help="Source checkpoint (folder or file).")]
DstArg = Annotated[Path, typer.Argument(help="Destination folder (must not exist).")]


@app.command("drafter")
def convert_drafter(
    src: SrcArg,
    dst: DstArg,
    dtype: Annotated[
        str, typer.Option("--dtype", help="float16, bfloat16 or float32.")
    ] = "float16",
    llm: Annotated[
        Path | None, typer.Option("--llm", help="mlx-lm folder the drafter must match.")
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on unused tensors.")] = False,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Apple's ReDrafter checkpoint (config.json + safetensors/.bin/.pt) -> MLX drafter."""
    from redrafter_mlx.conversion.drafter import convert_drafter as convert

    with user_errors(verbose):
        tic = time.perf_counter()
        with err.status("converting drafter"):
            out = convert(src, dst, dtype=dtype, force=force, llm=llm, strict=strict)
        err.print(f"wrote {out} in {time.perf_counter() - tic:.1f} s")


@app.command("llm")
def convert_llm(
    src: SrcArg,
    dst: DstArg,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="float32, float16 or bfloat16 (GGUF default: float32)."),
    ] = None,
    quantize: Annotated[bool, typer.Option("--quantize", "-q", help="Quantize weights.")] = False,
    q_bits: Annotated[int, typer.Option("--q-bits", help="Bits per weight: 4 or 8.")] = 4,
    q_group_size: Annotated[
        int, typer.Option("--q-group-size", help="Quantization group size.")
    ] = 64,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """A Hugging Face folder or repo id (via mlx-lm) or a .gguf file -> mlx-lm folder."""
    from redrafter_mlx.conversion.gguf import convert_gguf
    from redrafter_mlx.registry import convert_hf

    with user_errors(verbose):
        if q_bits not in (4, 8):
            raise ValueError(f"--q-bits must be 4 or 8, got {q_bits}")
        if dst.exists() and not force:
            raise ValueError(f"{dst} exists; pass --force")
        tic = time.perf_counter()
        if str(src).endswith(".gguf"):
            with progress_bar("dequantizing") as progress:
                if not quantize:
                    convert_gguf(src, dst, dtype=dtype or "float32", force=force, progress=progress)
                else:  # dequantize, then let mlx-lm quantize in its own format
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    with tempfile.TemporaryDirectory(dir=dst.parent) as t:
                        tmp = Path(t) / "float"
                        convert_gguf(src, tmp, dtype=dtype or "float32", progress=progress)
                        convert_hf(
                            tmp,
                            dst,
                            quantize=True,
                            q_bits=q_bits,
                            q_group_size=q_group_size,
                            force=force,
                        )
        else:
            with err.status("converting with mlx-lm"):
                convert_hf(
                    str(src),
                    dst,
                    dtype=dtype,
                    quantize=quantize,
                    q_bits=q_bits,
                    q_group_size=q_group_size,
                    force=force,
                )
        err.print(f"wrote {dst} in {time.perf_counter() - tic:.1f} s")
