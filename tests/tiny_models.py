"""Tiny random mlx-lm models and drafters, built in the tests (no downloads)."""

from __future__ import annotations

from redrafter_mlx.drafter import Drafter, DrafterConfig
from redrafter_mlx.greedy_head import GreedyHead

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma3_text, llama, qwen2

FAMILIES = ("llama", "qwen2", "gemma3_text")


def tiny_llm(
    family: str,
    vocab_size: int = 64,
    seed: int = 0,
    window: int = 8,
    scale: float = 2.0,
    hidden_size: int = 32,
    **kw,
) -> nn.Module:
    """A 2-4 layer float32 model of the given mlx-lm family with random weights.

    ``scale`` multiplies the default init: larger weights give peaked, input-dependent
    distributions (greedy tests); smaller ones flatter distributions (sampling tests).
    """
    mx.random.seed(seed)
    if family == "llama":
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=hidden_size,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=vocab_size,
            tie_word_embeddings=kw.pop("tie", False),
            **kw,
        )
        model = llama.Model(args)
    elif family == "llama_swa":  # llama with sliding-window layers (Mistral-style layer_types)
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=hidden_size,
            num_hidden_layers=3,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **kw,
        )
        model = llama.Model(args)
    elif family == "qwen2":
        args = qwen2.ModelArgs(
            model_type="qwen2",
            hidden_size=hidden_size,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=vocab_size,
            tie_word_embeddings=kw.pop("tie", True),
            **kw,
        )
        model = qwen2.Model(args)
    elif family == "gemma3_text":
        args = gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=hidden_size,
            num_hidden_layers=4,
            intermediate_size=64,
            num_attention_heads=2,
            head_dim=16,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            vocab_size=vocab_size,
            sliding_window=window,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
            **kw,
        )
        model = gemma3_text.Model(args)
    else:
        raise ValueError(family)
    model.update(tree_map(lambda p: p * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_drafter(hidden_size: int = 32, vocab_size: int = 64, seed: int = 0, **kw) -> Drafter:
    mx.random.seed(seed + 1000)
    drafter = Drafter(DrafterConfig(vocab_size=vocab_size, hidden_size=hidden_size, **kw))
    mx.eval(drafter.parameters())
    return drafter


def n_params(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def head_screen_of(weight: np.ndarray) -> GreedyHead:
    """The int8 screen of an LM head with this [V, H] float32 weight (H >= 128: the kernel's)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = mx.array(weight)
    model = nn.Module()
    model.lm_head = layer
    head = GreedyHead.for_model(model)
    assert head is not None
    return head


def record_calls(monkeypatch, cls: type, name: str) -> list:
    """Patch ``cls.name`` to run as before and append each call's result to the returned list."""
    results = []
    original = getattr(cls, name)

    def recorded(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        results.append(out)
        return out

    monkeypatch.setattr(cls, name, recorded)
    return results
