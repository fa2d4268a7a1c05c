"""The drafter training recipe, end to end: data, draft vocabulary, training, evaluation.

    data  = prompts -> the LLM's greedy answers -> their hidden states   (cached in data_dir)
    vocab = the V_d most frequent answer tokens                          (coverage reported)
    train = Apple's K-horizon objective, AdamW, warmup + cosine          (checkpoints, resume)
    eval  = held-out per-horizon accuracy and real tokens/step through the engine

The drafter goes to ``out/`` in the converter's format (``config.json`` with the draft
vocabulary, ``model.safetensors``) with ``report.json``, everything the run measured. Data
and checkpoints go to a work folder (default ``$REDRAFTER_HOME/train/<out name>``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import distill_data as data
from . import paths
from .adapters import adapter_for
from .beam_search import make_proposer
from .benchmark import consume
from .generate import stream_redrafter
from .llm import TreeLLM
from .loading import load, model_dims
from .training import (
    Example,
    TrainConfig,
    choose_draft_vocab,
    drafter_to_finetune,
    evaluate,
    init_head_from_llm,
    new_drafter,
    shrink_draft_vocab,
    train,
)

Log = Callable[[str], None]


def vocab_coverage(
    vocab: list[int] | None,
    train_ex: list[Example],
    eval_ex: list[Example],
    vocab_size: int,
    label: str,
    log: Log,
) -> tuple[float, float]:
    """Shares of training and held-out answer tokens inside ``vocab`` (None: all), logged."""

    def share(examples: list[Example]) -> float:
        tokens = np.concatenate([e.tokens for e in examples])
        return 1.0 if vocab is None else float(np.isin(tokens, vocab).mean())

    train_cover, eval_cover = share(train_ex), share(eval_ex)
    log(
        f"{label}: {len(vocab) if vocab else vocab_size} tokens, covering {train_cover:.1%} "
        f"of training and {eval_cover:.1%} of held-out answer tokens"
    )
    return train_cover, eval_cover


@dataclass
class Recipe:
    num_prompts: int = 1200
    held_out: int = 24  # prompts kept out of training, for evaluation
    max_new_tokens: int = 160
    gen_batch: int = 16
    draft_vocab: int | None = 16384  # None: the full vocabulary
    final_vocab: int | None = None  # shrink the trained draft vocab to this size before saving
    prompts_file: str | None = None  # a JSONL of prompts/texts instead of the stdlib corpus
    chat_share: float = 0.5  # stdlib prompts: > 0 asks every other one as a chat request
    fresh_prompts: bool = False  # stdlib prompts none of init_drafter's stages used
    answered_only: bool = False  # train on the prompts the data folder has answered; add none
    init_drafter: str | None = None  # go on training this drafter (its weights and vocabulary)
    dtype: str = "float16"  # of the saved drafter
    eval_width: int = 4
    eval_length: int = 5
    eval_tokens: int = 64
    train: TrainConfig = field(default_factory=TrainConfig)


def prepare_data(model, tokenizer, recipe: Recipe, data_dir: Path, log: Log, progress=None):
    """Prompts, generations and hidden states, each cached in ``data_dir``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if recipe.prompts_file and (recipe.fresh_prompts or recipe.chat_share != Recipe.chat_share):
        raise ValueError(
            "--completions-only and --fresh-prompts choose prompts from the standard library; "
            "a --prompts file is used as it is: drop one or the other"
        )
    if recipe.prompts_file:
        prompts = data.read_jsonl_prompts(recipe.prompts_file, tokenizer)
    else:
        used = set()
        if recipe.fresh_prompts:
            used = data.snippets_used_by([r["recipe"] for r in init_lineage(recipe)])
            log(f"prompts: skipping the {len(used)} the drafter's earlier stages used")
        prompts = data.build_prompts(
            tokenizer,
            recipe.num_prompts,
            seed=recipe.train.seed,
            chat_share=recipe.chat_share,
            exclude=used,
        )
    prompts_path = data_dir / "prompts.jsonl"
    cached = []
    if prompts_path.exists():
        cached = [json.loads(line) for line in prompts_path.read_text().splitlines()]
        # More prompts of the same corpus and seed extend the cache (their answers are kept);
        # anything else would silently train on other data than this recipe names.
        if cached != prompts[: len(cached)]:
            raise ValueError(
                f"{prompts_path} holds {len(cached)} prompts that are not the first of the "
                f"{len(prompts)} this run asks for (another --num-prompts below the cached "
                "count, --prompts, --seed or model?); use a new --work-dir, or delete the "
                "folder to start its data over"
            )
    if len(prompts) > len(cached):
        prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    log(f"prompts: {len(prompts)}" + (f" ({len(cached)} cached)" if cached else ""))
    tic = time.perf_counter()
    samples, hidden = data.generate_dataset(
        model,
        prompts,
        data_dir,
        stop_tokens=set(tokenizer.eos_token_ids),
        max_tokens=recipe.max_new_tokens,
        batch_size=recipe.gen_batch,
        progress=progress,
        answer_new=not recipe.answered_only,
    )
    gen_s = time.perf_counter() - tic
    examples = {
        i: Example(np.array(s.answer, np.int32), hidden[i])
        for i, s in enumerate(samples)
        if s.answer and i in hidden
    }
    if not examples:
        fix = (
            "drop --answered-only to answer them"
            if recipe.answered_only
            else "every answer was empty: check the prompts and --max-new-tokens"
        )
        raise ValueError(f"{data_dir}: no answered prompts to train on ({fix})")
    tokens = sum(len(e.tokens) for e in examples.values())
    log(f"answers: {len(examples)}, {tokens} tokens ({gen_s:.0f} s this run)")
    report = {"generation_s_this_run": gen_s, "answers": len(examples), "tokens": tokens}
    return samples, examples, report


def lineage(report: dict) -> list[dict]:
    """The training stages behind a drafter (their reports), oldest first: a drafter trained
    with ``init_drafter`` carries its starting point's report as ``init_report``."""
    stages = [report]
    while stages[0].get("init_report"):
        stages.insert(0, stages[0]["init_report"])
    if stages[0]["recipe"].get("init_drafter"):
        raise ValueError(
            f"the report continues {stages[0]['recipe']['init_drafter']} but does not hold "
            "its report (init_report); retrain with a redrafter-mlx that records it"
        )
    return stages


def init_lineage(recipe: Recipe) -> list[dict]:
    """The stages of the drafter ``recipe`` continues, from its ``report.json``."""
    if not recipe.init_drafter:
        raise ValueError(
            "fresh prompts skip those of the drafter being continued: pass --init-drafter"
        )
    parent = Path(recipe.init_drafter) / "report.json"
    if not parent.is_file():
        raise ValueError(
            "fresh prompts skip those the continued drafter was trained on, which its "
            "report.json names: pass --init-drafter with a drafter from `redrafter train` "
            f"(no {parent})"
        )
    return lineage(json.loads(parent.read_text()))


def held_out_ids(examples: dict[int, Example], held_out: int) -> list[int]:
    """The last ``held_out`` answered prompts (at most a fifth of them), kept for evaluation.

    With every prompt answered these are the corpus's last prompts; with ``answered_only``
    they are the last of those answered, so the held-out set is never empty by accident.
    """
    n_eval = min(held_out, max(len(examples) // 5, 1))
    return sorted(examples)[-n_eval:]


def tokens_per_step(llm: TreeLLM, drafter, prompts, width, length, max_tokens, stop) -> float:
    """Mean tokens per step of greedy ReDrafter over ``prompts``."""
    propose = make_proposer(drafter, llm.embed, width, length)
    steps = tokens = 0
    for i, p in enumerate(prompts):
        stream = stream_redrafter(llm, propose, p, max_tokens=max_tokens, stop_tokens=stop)
        r = consume("eval", i, stream)
        steps += r.steps
        tokens += len(r.tokens) - 1
    return tokens / max(steps, 1)


def run(
    model_path: str | Path,
    out: str | Path,
    recipe: Recipe,
    work_dir: str | Path | None = None,
    resume: bool = False,
    log: Log = print,
    on_train_log=None,
    progress=None,
) -> dict:
    """Train a drafter for the LLM at ``model_path``; return the report (also written)."""
    out = Path(out)
    work = Path(work_dir) if work_dir else paths.cache_dir() / "train" / out.name
    model, tokenizer, _ = load(model_path)
    hidden_size, vocab_size = model_dims(model)
    samples, examples, data_report = prepare_data(
        model, tokenizer, recipe, work / "data", log, progress
    )
    eval_ids = held_out_ids(examples, recipe.held_out)
    train_ex = [e for i, e in examples.items() if i not in eval_ids]
    eval_ex = [examples[i] for i in eval_ids]
    cfg = recipe.train
    if recipe.init_drafter:
        if cfg.head_init == "llm":
            raise ValueError(
                "head_init='llm' starts a new drafter, but init_drafter continues one: "
                "drop --head-init llm or --init-drafter"
            )
        drafter = drafter_to_finetune(recipe.init_drafter, cfg, hidden_size, vocab_size)
        vocab = drafter.config.draft_vocab
        log(f"continuing {recipe.init_drafter} (its draft vocabulary is kept)")
    else:
        vocab, _ = choose_draft_vocab(train_ex, recipe.draft_vocab, vocab_size)
        drafter = new_drafter(cfg, hidden_size, vocab_size, vocab)
    coverage, eval_cover = vocab_coverage(vocab, train_ex, eval_ex, vocab_size, "draft vocab", log)

    llm = TreeLLM(model)
    llm_rows = None  # the LLM's output rows of the draft vocab, for the KL term and the init
    if cfg.kl_weight > 0 or cfg.head_init == "llm":
        llm_rows = adapter_for(model).output_embeddings(model)
        if vocab is not None:
            llm_rows = llm_rows[mx.array(vocab)]
        llm_rows = llm_rows.astype(mx.float32)
    if cfg.head_init == "llm":
        init_head_from_llm(drafter, llm_rows)
    elif cfg.head_init != "random":
        raise ValueError(f"head_init must be 'random' or 'llm', got {cfg.head_init!r}")
    tic = time.perf_counter()
    drafter, state = train(
        drafter,
        llm.embed,
        train_ex,
        cfg,
        checkpoint_dir=work / "checkpoint",
        resume=resume,
        llm_head=llm_rows if cfg.kl_weight > 0 else None,
        on_log=on_train_log,
    )
    train_s = time.perf_counter() - tic
    if mx.distributed.init().rank() != 0:
        return {}
    if recipe.final_vocab is not None and recipe.final_vocab < drafter.config.output_size:
        drafter = shrink_draft_vocab(drafter, train_ex, recipe.final_vocab)
        vocab = drafter.config.draft_vocab
        coverage, eval_cover = vocab_coverage(
            vocab, train_ex, eval_ex, vocab_size, "draft vocab (shrunk)", log
        )
    accuracy = evaluate(drafter, llm.embed, eval_ex, cfg.horizons, cfg.window)
    eval_prompts = [samples[i].prompt for i in eval_ids][:8]
    tps = tokens_per_step(
        llm,
        drafter,
        eval_prompts,
        recipe.eval_width,
        recipe.eval_length,
        recipe.eval_tokens,
        tokenizer.eos_token_ids,
    )
    log(
        f"held-out top-1 accuracy by horizon: {[round(a, 3) for a in accuracy]}; "
        f"tokens/step (W={recipe.eval_width}, L={recipe.eval_length}): {tps:.2f}"
    )
    drafter.set_dtype(getattr(mx, recipe.dtype))
    drafter.config.extra.update({"trained_with": "redrafter-mlx", "horizons": cfg.horizons})
    drafter.save_pretrained(out)
    report = {
        "model": str(model_path),
        "recipe": asdict(recipe),
        "data": data_report,
        "draft_vocab_size": len(vocab) if vocab else vocab_size,
        "draft_vocab_coverage_train": coverage,
        "draft_vocab_coverage_heldout": eval_cover,
        "train_steps": state.step,
        "train_seconds": state.seconds,
        "train_tokens_per_s": state.tokens_seen / max(state.seconds, 1e-9),
        "train_seconds_this_run": train_s,
        "heldout_accuracy_by_horizon": accuracy,
        "heldout_tokens_per_step": tps,
        "history": state.history,
    }
    if recipe.init_drafter:
        # A continued drafter's card must say how its starting point was trained too.
        parent = Path(recipe.init_drafter) / "report.json"
        report["init_report"] = json.loads(parent.read_text()) if parent.is_file() else None
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
