"""The ``redrafter`` command line (thin over the library)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import redrafter_mlx  # noqa: F401  (loads OpenBLAS before mlx on Linux)

import typer
from rich.console import Console

app = typer.Typer(
    help="ReDrafter speculative decoding for LLMs on MLX.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


@app.callback()
def main() -> None:
    """ReDrafter speculative decoding for LLMs on MLX."""


# Option types shared by the commands (flag names follow mlx-lm's CLI).
ModelOpt = Annotated[Path, typer.Option("--model", help="mlx-lm model folder.")]
DrafterOpt = Annotated[Path | None, typer.Option("--drafter", help="Drafter folder (MLX).")]
PromptOpt = Annotated[str, typer.Option("--prompt", "-p", help="Prompt text; '-' reads stdin.")]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-m", help="Tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Sampling temperature (0: greedy).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold (0: off).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Sample among the k most likely (0: off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling threshold (0: off).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed for sampling.")]
WidthOpt = Annotated[int, typer.Option("--beam-width", help="Beams drafted per step (W).")]
LengthOpt = Annotated[int, typer.Option("--beam-length", help="Tokens per beam, g0 included.")]
NoDraftOpt = Annotated[bool, typer.Option("--no-draft", help="Plain mlx-lm decoding instead.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show tracebacks on errors.")]


@app.command()
def generate(
    model: ModelOpt,
    prompt: PromptOpt,
    drafter: DrafterOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    beam_width: WidthOpt = 4,
    beam_length: LengthOpt = 5,
    no_draft: NoDraftOpt = False,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text from a prompt, streaming tokens as they are accepted."""
    from redrafter_mlx.generate import stream_autoregressive, stream_generate
    from redrafter_mlx.loading import load
    from redrafter_mlx.verification import SamplingParams

    import mlx.core as mx

    try:
        text = sys.stdin.read() if prompt == "-" else prompt
        if not no_draft and drafter is None:
            raise ValueError("--drafter is required (or pass --no-draft for plain decoding)")
        llm, tokenizer, draft_model = load(model, None if no_draft else drafter)
        sampling = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        if seed is not None:
            mx.random.seed(seed)
        ids = tokenizer.encode(text)
        kw = dict(max_tokens=max_tokens, sampling=sampling, stop_tokens=tokenizer.eos_token_ids)
        if no_draft:
            stream = stream_autoregressive(llm, ids, **kw)
        else:
            stream = stream_generate(
                llm, draft_model, ids, beam_width=beam_width, beam_length=beam_length, **kw
            )
        detok = tokenizer.detokenizer
        detok.reset()
        tokens: list[int] = []
        summary = None
        for out in stream:
            tokens += out.tokens
            summary = out.summary
            for t in out.tokens:
                detok.add_token(t)
            if not as_json:
                print(detok.last_segment, end="", flush=True)
        detok.finalize()
    except (ValueError, FileNotFoundError) as e:
        if verbose:
            raise
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    if as_json:
        print(
            json.dumps(
                dict(
                    text=detok.text,
                    token_ids=tokens,
                    num_tokens=len(tokens),
                    steps=summary.steps,
                    tokens_per_step=summary.tokens_per_step,
                    prompt_tps=summary.prompt_tps,
                    generation_tps=summary.generation_tps,
                    peak_memory_gb=summary.peak_memory_gb,
                    settings=dict(
                        temp=temp,
                        top_p=top_p,
                        top_k=top_k,
                        min_p=min_p,
                        seed=seed,
                        beam_width=beam_width,
                        beam_length=beam_length,
                        no_draft=no_draft,
                    ),
                )
            )
        )
        return
    print(detok.last_segment)
    err.print(
        f"[dim]prompt: {summary.prompt_tokens} tokens, {summary.prompt_tps:.1f} tokens/s | "
        f"generation: {summary.generation_tokens} tokens, {summary.generation_tps:.1f} tokens/s, "
        f"{summary.tokens_per_step:.2f} tokens/step | peak memory {summary.peak_memory_gb:.2f} GB"
    )


if __name__ == "__main__":
    app()
