"""``redrafter generate``: one prompt, streamed, then a summary like mlx-lm's."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import (
    DrafterOpt,
    FullHeadOpt,
    LengthOpt,
    LookupOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    NoDraftOpt,
    PruneOpt,
    SeedOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    WidthOpt,
    defaults,
    err,
    read_prompt,
    resolve,
    tree_budget,
    user_errors,
)

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def generate(
    model: ModelOpt = None,
    drafter: DrafterOpt = None,
    prompt: Annotated[
        str, typer.Option("--prompt", "-p", help="Prompt text; '-' reads stdin.")
    ] = DEFAULT_PROMPT,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    beam_width: WidthOpt = None,
    beam_length: LengthOpt = None,
    prune: PruneOpt = None,
    lookup: LookupOpt = 2,
    no_draft: NoDraftOpt = False,
    full_head: FullHeadOpt = False,
    ignore_chat_template: Annotated[
        bool, typer.Option("--ignore-chat-template", help="Feed the prompt as raw text.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate from a prompt, streaming tokens as they are accepted."""
    with user_errors(verbose):
        from redrafter_mlx.generate import stream_autoregressive, stream_generate
        from redrafter_mlx.loading import load
        from redrafter_mlx.verification import SamplingParams

        import mlx.core as mx

        text = read_prompt(prompt)
        model_dir, drafter_dir, entry = resolve(model, drafter, no_draft)
        W, L = defaults(model_dir, drafter_dir, entry, beam_width, beam_length)
        llm, tokenizer, draft_model = load(model_dir, drafter_dir, cast_drafter=False)
        sampling = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        if seed is not None:
            mx.random.seed(seed)
        if not ignore_chat_template and tokenizer.chat_template is not None:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
        else:
            ids = tokenizer.encode(text)
        kw = dict(max_tokens=max_tokens, sampling=sampling, stop_tokens=tokenizer.eos_token_ids)
        budget = None
        if no_draft:
            stream = stream_autoregressive(llm, ids, **kw)
        else:
            budget = tree_budget(model_dir, drafter_dir, llm, draft_model, W, L, prune)
            stream = stream_generate(
                llm,
                draft_model,
                ids,
                beam_width=W,
                beam_length=L,
                budget=budget,
                lookup=lookup,
                head_screen=not full_head,
                **kw,
            )
        detok = tokenizer.detokenizer
        detok.reset()
        tokens: list[int] = []
        for out in stream:
            tokens += out.tokens
            summary = out.summary
            for t in out.tokens:
                detok.add_token(t)
            if not as_json:
                print(detok.last_segment, end="", flush=True)
        detok.finalize()
    if as_json:
        settings = dict(
            model=str(model_dir),
            drafter=str(drafter_dir) if drafter_dir else None,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            beam_width=W,
            beam_length=L,
            prune=budget is not None,
            lookup=0 if no_draft else lookup,
            no_draft=no_draft,
            full_head=full_head,
            max_tokens=max_tokens,
        )
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
                    finish_reason=summary.finish_reason,
                    settings=settings,
                )
            )
        )
        return
    print(detok.last_segment)
    err.print(
        f"[dim]Prompt: {summary.prompt_tokens} tokens, {summary.prompt_tps:.3f} tokens-per-sec\n"
        f"Generation: {summary.generation_tokens} tokens, "
        f"{summary.generation_tps:.3f} tokens-per-sec, {summary.tokens_per_step:.2f} tokens/step\n"
        f"Peak memory: {summary.peak_memory_gb:.3f} GB[/dim]"
    )
