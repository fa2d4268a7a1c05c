"""Load an mlx-lm model and a drafter, and check they belong together."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .adapters import adapter_for
from .drafter import Drafter


def model_dims(model: nn.Module) -> tuple[int, int]:
    """(hidden_size, vocab_size) of an mlx-lm model, read from its embedding table."""
    embed = adapter_for(model).embed_tokens(model)
    vocab, hidden = embed.weight.shape
    if hasattr(embed, "bits"):  # QuantizedEmbedding packs weights: use its dims
        hidden = embed.dims
        vocab = embed.num_embeddings
    return int(hidden), int(vocab)


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The LLM's activation dtype: its embedding table's (scales' when quantized)."""
    embed = adapter_for(model).embed_tokens(model)
    return embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype


def check_compatible(drafter: Drafter, model: nn.Module, where: str = "drafter") -> None:
    """Raise a clear error if the drafter was not made for this LLM's hidden size and vocab."""
    hidden, vocab = model_dims(model)
    cfg = drafter.config
    if cfg.hidden_size != hidden:
        raise ValueError(
            f"{where}: hidden_size {cfg.hidden_size} does not match the LLM's {hidden}; "
            "a drafter only works with the LLM it was trained for"
        )
    if cfg.vocab_size != vocab:
        raise ValueError(
            f"{where}: vocab_size {cfg.vocab_size} does not match the LLM's {vocab}; "
            "a drafter only works with the LLM it was trained for"
        )


def match_dtype(drafter: Drafter, model: nn.Module) -> None:
    """Make the drafter compute in the LLM's dtype, in place (a no-op once it does).

    Drafters ship in float16 to stay small, but on the CPU backend float16 matmuls are several
    times slower than float32: a float16 beam search beside a float32 LLM made a step of the
    demo model ~25% slower. The int8 one-beam drafts read float16 as it is, which is why
    generation casts only where it searches in float (``dtype`` in
    :func:`~redrafter_mlx.beam_search.make_proposer`; ``load(..., cast_drafter=False)``).
    Outputs do not change (the LLM verifies every drafted token).
    """
    dtype = compute_dtype(model)
    if drafter.dtype != dtype:
        drafter.set_dtype(dtype)


def load(model_path: str | Path, drafter_path: str | Path | None = None, cast_drafter: bool = True):
    """Load ``(model, tokenizer, drafter)``; drafter is None when no path is given.

    The drafter computes in the LLM's dtype (:func:`match_dtype`), or with ``cast_drafter=False``
    keeps the dtype it was saved in until generation needs another (``stream_generate`` casts
    it only where it drafts in floating point: a shipped float16 drafter drafting from int8
    copies stays float16, half the resident bytes).
    """
    from mlx_lm import load as mlx_lm_load

    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such model folder (convert one with `redrafter convert llm`)"
        )
    model, tokenizer = mlx_lm_load(str(path))
    adapter_for(model)  # fail early, with the list of supported families
    drafter = None
    if drafter_path is not None:
        drafter = Drafter.from_pretrained(drafter_path)
        check_compatible(drafter, model, where=str(drafter_path))
        if cast_drafter:
            match_dtype(drafter, model)
    return model, tokenizer, drafter
