"""``redrafter train``: distil a drafter from an LLM, end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .common import ModelOpt, VerboseOpt, err, user_errors


def opt(flag: str, help: str):  # noqa: A002  (typer's parameter name)
    return typer.Option(flag, help=help)


def train(
    model: ModelOpt = None,
    out: Annotated[Path | None, opt("--out", "Drafter folder to write.")] = None,
    work_dir: Annotated[Path | None, opt("--work-dir", "Data/checkpoint folder.")] = None,
    prompts: Annotated[Path | None, opt("--prompts", "JSONL of prompts (default: stdlib).")] = None,
    num_prompts: Annotated[int, opt("--num-prompts", "Prompts drawn from the corpus.")] = 1200,
    completions_only: Annotated[
        bool, opt("--completions-only", "Stdlib prompts as raw code completions, no chat.")
    ] = False,
    fresh_prompts: Annotated[
        bool, opt("--fresh-prompts", "Stdlib prompts the --init-drafter was not trained on.")
    ] = False,
    held_out: Annotated[int, opt("--held-out", "Prompts kept for evaluation.")] = 24,
    max_new_tokens: Annotated[int, opt("--max-new-tokens", "Answer length cap.")] = 160,
    gen_batch: Annotated[int, opt("--gen-batch", "Prompts answered per batch.")] = 16,
    draft_vocab: Annotated[int, opt("--draft-vocab", "Draft vocabulary size (0: full).")] = 16384,
    final_vocab: Annotated[
        int, opt("--final-vocab", "Shrink the trained draft vocab to N tokens (0: keep).")
    ] = 0,
    horizons: Annotated[int, opt("--horizons", "Tokens predicted per position (K).")] = 5,
    window: Annotated[int, opt("--window", "Positions per training row.")] = 128,
    batch_rows: Annotated[int, opt("--batch-rows", "Rows per optimizer step.")] = 16,
    grad_accum: Annotated[int, opt("--grad-accum", "Micro-batches per step.")] = 1,
    max_steps: Annotated[int, opt("--max-steps", "Optimizer steps.")] = 1000,
    lr: Annotated[float, opt("--lr", "Peak learning rate (AdamW).")] = 1e-3,
    warmup: Annotated[int, opt("--warmup", "Linear warmup steps before cosine decay.")] = 50,
    kl_weight: Annotated[
        float, opt("--kl-weight", "Weight of the KL to the LLM's distributions (0: off).")
    ] = 0.0,
    grad_clip: Annotated[float, opt("--grad-clip", "Max gradient norm (0: off).")] = 1.0,
    num_draft_layers: Annotated[int, opt("--num-draft-layers", "ResNet blocks in the head.")] = 2,
    no_rnn: Annotated[bool, opt("--no-rnn", "Additive state instead of the RNN.")] = False,
    head_init: Annotated[
        str, opt("--head-init", "random, or llm: start from the LLM's output layer.")
    ] = "random",
    init_drafter: Annotated[
        Path | None,
        opt("--init-drafter", "Go on training this drafter (keeps its draft vocabulary)."),
    ] = None,
    seed: Annotated[int, opt("--seed", "Seed for prompts, init and shuffling.")] = 0,
    checkpoint_every: Annotated[int, opt("--checkpoint-every", "Steps between checkpoints.")] = 200,
    resume: Annotated[bool, opt("--resume", "Continue from the last checkpoint.")] = False,
    dtype: Annotated[str, opt("--dtype", "Saved drafter dtype.")] = "float16",
    data_only: Annotated[bool, opt("--data-only", "Prepare the data, then stop.")] = False,
    answered_only: Annotated[
        bool, opt("--answered-only", "Train on the prompts already answered; answer none.")
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Train a drafter by distillation from the LLM itself (runs on CPU or Metal)."""
    with user_errors(verbose):
        from redrafter_mlx import paths, recipe, registry
        from redrafter_mlx.loading import load
        from redrafter_mlx.training import TrainConfig

        model_dir, entry = registry.resolve_model(model)
        name = entry.name if entry else model_dir.name
        out = out or paths.cache_dir() / "drafters" / name
        cfg = TrainConfig(
            horizons=horizons,
            window=window,
            batch_rows=batch_rows,
            grad_accum=grad_accum,
            steps=max_steps,
            lr=lr,
            warmup=min(warmup, max_steps),
            kl_weight=kl_weight,
            grad_clip=grad_clip or None,
            num_draft_layers=num_draft_layers,
            rnn=not no_rnn,
            head_init=head_init,
            seed=seed,
            checkpoint_every=checkpoint_every,
        )
        plan = recipe.Recipe(
            num_prompts=num_prompts,
            held_out=held_out,
            max_new_tokens=max_new_tokens,
            gen_batch=gen_batch,
            draft_vocab=draft_vocab or None,
            final_vocab=final_vocab or None,
            prompts_file=str(prompts) if prompts else None,
            chat_share=0.0 if completions_only else 0.5,
            fresh_prompts=fresh_prompts,
            answered_only=answered_only,
            init_drafter=str(init_drafter) if init_drafter else None,
            dtype=dtype,
            train=cfg,
        )
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with Progress(*columns, console=err, disable=not err.is_terminal) as bar:
            gen_task = bar.add_task("generating", total=None, info="")
            train_task = bar.add_task("training", total=max_steps, info="", visible=False)

            def on_gen(done: int, total: int) -> None:  # once per answered batch
                bar.update(gen_task, completed=done, total=total)
                if not err.is_terminal:  # a log file: plain lines instead of the bar
                    err.print(f"answered {done}/{total} prompts")

            def on_train(state, log) -> None:
                acc = " ".join(f"{a:.2f}" for a in log["acc"])
                info = (
                    f"loss {log['loss']:.3f} acc@1..{len(log['acc'])} {acc} "
                    f"|g| {log['grad_norm']:.2f}"
                )
                bar.update(train_task, completed=state.step, info=info, visible=True)
                if not err.is_terminal:
                    err.print(f"step {state.step}: {info}, {log['tokens_per_s']:.0f} tokens/s")

            if data_only:
                llm, tokenizer, _ = load(model_dir)
                work = work_dir or paths.cache_dir() / "train" / out.name
                recipe.prepare_data(llm, tokenizer, plan, work / "data", err.print, on_gen)
                return
            report = recipe.run(
                model_dir,
                out,
                plan,
                work_dir=work_dir,
                resume=resume,
                log=err.print,
                on_train_log=on_train,
                progress=on_gen,
            )
        if report:
            err.print(
                f"wrote {out}: held-out tokens/step {report['heldout_tokens_per_step']:.2f}, "
                f"training {report['train_tokens_per_s']:.0f} tokens/s"
            )
