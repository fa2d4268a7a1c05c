"""Convert a llama.cpp GGUF file into an mlx-lm model folder.

The output folder holds ``config.json``, ``model.safetensors`` (dequantized weights in one
dtype), ``tokenizer.json`` + ``tokenizer_config.json`` (and ``tokenizer.model`` for
SentencePiece vocabularies), so that ``mlx_lm.load(folder)`` opens it without a model hub.

Supported architectures: ``qwen2`` (mlx-lm ``qwen2``), ``llama`` (``llama``) and ``gemma3``
(``gemma3_text``). What llama.cpp's converter changed on the way into GGUF is undone here:

- GGUF lists dimensions innermost first; the reader's numpy view is already in the usual
  ``(out_features, in_features)`` order, which is what mlx ``nn.Linear`` stores.
- ``llama``: Q/K rows were permuted from Hugging Face's rotate-half RoPE layout to the
  interleaved-pair layout that llama.cpp's ``llama`` kernels use; we apply the inverse
  permutation and keep mlx-lm's (rotate-half) RoPE. ``qwen2`` and ``gemma3`` run NeoX-style
  RoPE in llama.cpp and were never permuted.
- ``gemma3``: every ``*norm.weight`` carries llama.cpp's ``+1``; mlx-lm's RMSNorm multiplies
  by ``1 + weight``, so we subtract 1.

Every problem with the input raises :class:`ConversionError` with a one-line message that
names the file. The destination is built in a temporary folder next to it and renamed into
place, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import atomic_folder
from .errors import ConversionError

__all__ = ["ConversionError", "convert_gguf", "read_gguf"]

#: GGUF architecture -> mlx-lm model_type.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
DTYPES = ("float32", "float16", "bfloat16")

#: Called as ``progress(done, total, tensor_name)`` while tensors are dequantized.
Progress = Callable[[int, int, str], None]

# GGUF token types (the same numbering as SentencePiece's piece types).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)

# Pre-tokenizer split patterns for byte-level BPE vocabularies, by `tokenizer.ggml.pre`.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: pre name -> (split regex or None for GPT-2's built-in one, NFC normalize, ignore_merges)
_BPE_PRE = {
    "qwen2": (_QWEN2_SPLIT, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "gpt-2": (None, False, False),
    "gpt2": (None, False, False),
    "default": (None, False, False),
}

#: Tokens llama.cpp also treats as end-of-generation when they are control tokens.
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>")

# A Gemma 3 chat template (written for this converter) for GGUFs of base models that ship none.
_GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] | trim + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '')"
    " + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

_REQUIRED = object()


@dataclass
class GGUFModel:
    """An opened GGUF file: its path, the ``gguf.GGUFReader`` and the architecture name."""

    path: Path
    reader: Any
    arch: str

    def meta(self, key: str, default: Any = _REQUIRED) -> Any:
        """Metadata value of ``key`` (``{arch}`` is substituted), or ``default``."""
        key = key.format(arch=self.arch)
        field = self.reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise ConversionError(f"{self.path}: missing GGUF metadata key {key!r}")
            return default
        value = field.contents()
        return value.item() if isinstance(value, np.generic) else value

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def read_gguf(src: str | Path) -> GGUFModel:
    """Open ``src`` with ``gguf.GGUFReader``; fail with :class:`ConversionError` on bad input."""
    path = Path(src)
    if not path.exists():
        raise ConversionError(f"{path}: no such file")
    if not path.is_file():
        raise ConversionError(f"{path}: not a file")
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
        raise ConversionError(
            f"{path}: not a readable GGUF file (truncated or corrupt): {_one_line(e)}"
        ) from e
    _check_tensor_extents(path, reader)
    field = reader.get_field("general.architecture")
    if field is None:
        raise ConversionError(f"{path}: missing GGUF metadata key 'general.architecture'")
    arch = str(field.contents())
    if arch not in MODEL_TYPES:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise ConversionError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    return GGUFModel(path, reader, arch)


def _check_tensor_extents(path: Path, reader: Any) -> None:
    """Memory maps of a cut file can silently come up short; check every tensor fits."""
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConversionError(
                f"{path}: truncated GGUF: tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes}, file has {size}"
            )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def dequantize(model: GGUFModel, tensor: Any) -> np.ndarray:
    """Tensor data as float32 numpy, in numpy (row-major, outermost-first) dimension order."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    qtype = tensor.tensor_type
    name = getattr(qtype, "name", str(qtype))
    try:
        if qtype == Q.F64:
            array = np.asarray(tensor.data, dtype=np.float32)
        elif qtype in (Q.I8, Q.I16, Q.I32, Q.I64):
            raise NotImplementedError("integer tensors are not weights")
        else:
            array = quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ConversionError(
            f"{model.path}: tensor {tensor.name} has unsupported type {name} ({_one_line(e)})"
        ) from e
    except (ValueError, TypeError, IndexError) as e:  # bad block bytes / sizes
        raise ConversionError(
            f"{model.path}: cannot decode tensor {tensor.name} ({name}): {_one_line(e)}"
        ) from e
    # GGUF shapes are innermost-first: ne = [in, out] for a (out, in) matrix.
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    if array.size != math.prod(shape):
        raise ConversionError(
            f"{model.path}: tensor {tensor.name} ({name}) holds {array.size} values, "
            f"its shape {shape} needs {math.prod(shape)}"
        )
    return np.asarray(array, dtype=np.float32).reshape(shape)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def build_config(model: GGUFModel) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for ``model`` (hyper-parameters from GGUF metadata)."""
    names = model.tensor_names()
    embd = _tensor(model, "token_embd.weight")
    vocab_size = int(embd.shape[1])  # ne = [hidden, vocab]
    hidden = int(model.meta("{arch}.embedding_length"))
    n_head = _first_int(model.meta("{arch}.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": MODEL_TYPES[model.arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(model.meta("{arch}.block_count")),
        "intermediate_size": _first_int(model.meta("{arch}.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": _first_int(model.meta("{arch}.attention.head_count_kv", n_head)),
        "rms_norm_eps": _f32(model.meta("{arch}.attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab_size,
        "rope_theta": _f32(model.meta("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(model.meta("{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
    }
    head_dim = model.meta("{arch}.attention.key_length", None)
    if head_dim is None:
        head_dim = model.meta("{arch}.rope.dimension_count", hidden // n_head)
    config["head_dim"] = int(head_dim)
    if (scaling := _rope_scaling(model)) is not None:
        config["rope_scaling"] = scaling
    if model.arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    elif model.arch == "gemma3":
        config.update(_gemma3_config(model, config))
    if (eos := eos_token_ids(model)) is not None:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return config


def _tensor(model: GGUFModel, name: str) -> Any:
    for t in model.reader.tensors:
        if t.name == name:
            return t
    raise ConversionError(f"{model.path}: missing tensor {name}")


def _f32(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _first_int(value: Any) -> int:
    """Per-layer arrays (some GGUFs list head counts per layer) -> their common value."""
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer values differ: {value}")
        return int(value[0])
    return int(value)


def _rope_scaling(model: GGUFModel) -> dict[str, Any] | None:
    kind = model.meta("{arch}.rope.scaling.type", "none")
    factor = model.meta("{arch}.rope.scaling.factor", None)
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        ctx = model.meta("{arch}.rope.scaling.original_context_length", None)
        if ctx:
            scaling["original_max_position_embeddings"] = int(ctx)
        return scaling
    if kind not in ("none", "linear", "yarn"):
        raise ConversionError(f"{model.path}: unsupported RoPE scaling type {kind!r}")
    return None


def _gemma3_config(model: GGUFModel, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 settings; defaults are the ones llama.cpp hard-codes when keys are absent."""
    head_dim = config["head_dim"]
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B (62 layers):
    # 1/sqrt(hidden/heads).
    scalar = head_dim
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "sliding_window": int(model.meta("{arch}.attention.sliding_window", 512)),
        "sliding_window_pattern": _sliding_window_pattern(model),
        "rope_local_base_freq": _f32(model.meta("{arch}.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": int(scalar),
    }


def _sliding_window_pattern(model: GGUFModel) -> int:
    """mlx-lm wants "every N-th layer is global"; GGUF has an int, a per-layer list or nothing."""
    value = model.meta("{arch}.attention.sliding_window_pattern", 6)
    if not isinstance(value, list):
        return int(value)
    is_swa = [bool(v) for v in value]
    period = next((i + 1 for i, swa in enumerate(is_swa) if not swa), len(is_swa) + 1)
    if any(swa != ((i + 1) % period != 0) for i, swa in enumerate(is_swa)):
        raise ConversionError(f"{model.path}: sliding-window layer pattern is not periodic")
    return period


def _llama3_rope_scaling(model: GGUFModel, config: dict[str, Any], factors: np.ndarray) -> dict:
    """Recover Llama 3.x RoPE scaling from llama.cpp's precomputed ``rope_freqs`` tensor.

    llama.cpp stores per-frequency divisors computed from (factor, low_freq_factor,
    high_freq_factor, original context). Assume Llama 3.1/3.2's 1 / 4 / 8192 and the largest
    divisor as factor, recompute the divisors, and accept only an exact fit.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dim = int(model.meta("{arch}.rope.dimension_count", config["head_dim"]))
    expected = _llama3_divisors(config["rope_theta"], dim, scaling)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ConversionError(
            f"{model.path}: rope_freqs.weight does not match Llama 3 RoPE scaling "
            "(low_freq_factor=1, high_freq_factor=4, original context 8192)"
        )
    return scaling


def _llama3_divisors(base: float, dim: int, s: dict[str, Any]) -> np.ndarray:
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    ctx, low, high, factor = (
        s["original_max_position_embeddings"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["factor"],
    )
    smooth = (ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, mid))
    return out.astype(np.float32)


def eos_token_ids(model: GGUFModel) -> list[int] | None:
    """EOS plus the end-of-turn ids llama.cpp also stops on, in a stable order."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):  # fmt: skip
        value = model.meta(key, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = model.meta("tokenizer.ggml.tokens", None)
    types = model.meta("tokenizer.ggml.token_type", None)
    if tokens is not None and types is not None:
        index = {t: i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
        for text in _EOG_TEXTS:
            i = index.get(text)
            if i is not None and types[i] == TOKEN_CONTROL and i not in ids:
                ids.append(i)
    return ids or None


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Gemma 3 has four norms per block; llama/qwen2 have two.
_BLOCK_BY_ARCH = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: Tensors llama.cpp adds that are not parameters (handled through the config instead).
_NOT_PARAMETERS = {"rope_freqs.weight"}


def mlx_name(arch: str, gguf_name: str) -> str | None:
    """mlx-lm parameter name for a GGUF tensor name, or None when there is none."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    target = _BLOCK_BY_ARCH[arch].get(part) or _BLOCK.get(part)
    return None if target is None else f"model.layers.{layer}.{target}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation for the ``llama`` architecture.

    llama.cpp reorders each head's rows from rotate-half order (pairs ``i`` and
    ``i + d/2``) to interleaved order (pairs ``2i`` and ``2i + 1``):
    rows viewed as (n_head, 2, d/2) -> (n_head, d/2, 2). We go back:
    (n_head, d/2, 2) -> (n_head, 2, d/2). Works for weights (rows, in) and biases (rows,).
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def fix_tensor(arch: str, name: str, w: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undo what llama.cpp's converter did to this (already renamed) tensor."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - 1.0  # llama.cpp stored 1 + w; mlx-lm's Gemma RMSNorm adds the 1 itself
    if arch == "llama":
        if ".self_attn.q_proj." in name:
            return unpermute_qk(w, config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_qk(w, config["num_key_value_heads"])
    return w


def load_weights(
    model: GGUFModel, config: dict[str, Any], progress: Progress | None = None
) -> dict[str, np.ndarray]:
    """All tensors dequantized, renamed to mlx-lm names and fixed up (float32 numpy)."""
    weights: dict[str, np.ndarray] = {}
    tensors = list(model.reader.tensors)
    for i, t in enumerate(tensors):
        if progress is not None:
            progress(i, len(tensors), t.name)
        if t.name in _NOT_PARAMETERS:
            if t.name == "rope_freqs.weight" and model.arch == "llama":
                config["rope_scaling"] = _llama3_rope_scaling(model, config, dequantize(model, t))
            continue
        name = mlx_name(model.arch, t.name)
        if name is None:
            raise ConversionError(
                f"{model.path}: tensor {t.name} has no mlx-lm {MODEL_TYPES[model.arch]} counterpart"
            )
        weights[name] = fix_tensor(model.arch, name, dequantize(model, t), config)
    if progress is not None:
        progress(len(tensors), len(tensors), "")
    return weights


def check_shapes(model: GGUFModel, config: dict[str, Any], weights: dict[str, Any]) -> None:
    """Compare every tensor with a freshly built mlx-lm model (lazy: nothing is allocated)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    try:
        net = module.Model(module.ModelArgs.from_dict(config))
    except Exception as e:
        raise ConversionError(f"{model.path}: mlx-lm rejects the config: {_one_line(e)}") from e
    placeholders = {k: mx.zeros((1,)) for k in weights}
    kept = set(net.sanitize(placeholders)) if hasattr(net, "sanitize") else set(weights)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(net.parameters())}
    kind = config["model_type"]
    if missing := sorted(set(expected) - kept):
        raise ConversionError(
            f"{model.path}: no tensor for mlx-lm {kind} parameter {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    if extra := sorted(kept - set(expected)):
        raise ConversionError(f"{model.path}: mlx-lm {kind} has no parameter {extra[0]}")
    for name in sorted(expected):
        got = tuple(weights[name].shape)
        if got != expected[name]:
            raise ConversionError(
                f"{model.path}: shape mismatch for {name}: GGUF gives {got}, "
                f"mlx-lm {kind} expects {expected[name]}"
            )


def save_weights(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    import mlx.core as mx

    target = getattr(mx, dtype)
    arrays = {k: mx.array(v).astype(target) for k, v in weights.items()}
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


@dataclass
class Vocab:
    """The tokenizer part of a GGUF file."""

    kind: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None

    def special_id(self, model: GGUFModel, what: str) -> int | None:
        value = model.meta(f"tokenizer.ggml.{what}_token_id", None)
        if value is None or not 0 <= int(value) < len(self.tokens):
            return None
        return int(value)

    def special_text(self, model: GGUFModel, what: str) -> str | None:
        i = self.special_id(model, what)
        return None if i is None else self.tokens[i]


def read_vocab(model: GGUFModel) -> Vocab:
    kind = model.meta("tokenizer.ggml.model")
    tokens = [str(t) for t in model.meta("tokenizer.ggml.tokens")]
    types = model.meta("tokenizer.ggml.token_type", None)
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * len(tokens)
    scores = model.meta("tokenizer.ggml.scores", None)
    merges = model.meta("tokenizer.ggml.merges", None)
    if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
        raise ConversionError(f"{model.path}: tokenizer arrays have different lengths")
    return Vocab(
        kind=str(kind),
        pre=str(model.meta("tokenizer.ggml.pre", "default")),
        tokens=tokens,
        types=types,
        scores=[float(s) for s in scores] if scores is not None else None,
        merges=[str(m) for m in merges] if merges is not None else None,
    )


def _added_tokens(vocab: Vocab) -> tuple[list[Any], list[Any]]:
    """(special, plain) AddedTokens: control/unknown tokens are special, user-defined plain."""
    from tokenizers import AddedToken

    special, plain = [], []
    for text, kind in zip(vocab.tokens, vocab.types, strict=True):
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            plain.append(AddedToken(text, special=False, normalized=False))
    return special, plain


def build_bpe_tokenizer(model: GGUFModel, vocab: Vocab) -> Any:
    """Byte-level BPE (GPT-2 family: Qwen2, Llama 3) from GGUF tokens and merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if vocab.merges is None:
        raise ConversionError(f"{model.path}: gpt2 tokenizer without tokenizer.ggml.merges")
    if vocab.pre not in _BPE_PRE:
        raise ConversionError(
            f"{model.path}: unsupported BPE pre-tokenizer {vocab.pre!r} "
            f"(supported: {', '.join(sorted(_BPE_PRE))})"
        )
    split, nfc, ignore_merges = _BPE_PRE[vocab.pre]
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(vocab.tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=ignore_merges,
    )
    tok = Tokenizer(bpe)
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    _add_tokens_and_post_processor(model, vocab, tok, byte_level=True)
    return tok


def spm_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece-BPE's score-driven merging.

    SentencePiece merges the adjacent pair whose concatenation is the highest-scoring
    vocabulary piece. A Hugging Face BPE gets the same order from a merge list sorted by the
    merged piece's score (ties: shorter left part first, then vocabulary order). Only normal
    pieces take part: control/user-defined/byte pieces are never built by merging.
    """
    assert vocab.scores is not None
    normal = {t: i for i, (t, k) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
              if k == TOKEN_NORMAL}  # fmt: skip
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[i], cut, i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(model: GGUFModel, vocab: Vocab) -> Any:
    """SentencePiece-BPE (Gemma, Llama 2) as a Hugging Face BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if vocab.scores is None:
        raise ConversionError(f"{model.path}: SentencePiece tokenizer without scores")
    unk = vocab.special_text(model, "unknown") or next(
        (t for t, k in zip(vocab.tokens, vocab.types, strict=True) if k == TOKEN_UNKNOWN), None
    )
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(vocab.tokens)},
        merges=spm_merges(vocab),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    space_prefix = bool(model.meta("tokenizer.ggml.add_space_prefix", True))
    # The dummy "▁" prefix is a normalizer step, so it applies to every stretch of text
    # between added tokens: what llama.cpp does (and Meta's Llama 2 reference, which encodes
    # the text after <s> on its own). Without added tokens this is exactly SentencePiece.
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    # The decoder layouts mlx-lm recognises for streaming detokenization.
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    _add_tokens_and_post_processor(model, vocab, tok, byte_level=False)
    return tok


def _add_tokens_and_post_processor(
    model: GGUFModel, vocab: Vocab, tok: Any, byte_level: bool
) -> None:
    from tokenizers import processors

    special, plain = _added_tokens(vocab)
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    bos = vocab.special_text(model, "bos")
    eos = vocab.special_text(model, "eos")
    add_bos = bool(model.meta("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(model.meta("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre = [f"{bos}"] if add_bos else []
        post = [f"{eos}"] if add_eos else []
        ids = {t: vocab.tokens.index(t) for t in pre + post}
        steps.append(
            processors.TemplateProcessing(
                single=" ".join([*pre, "$A", *post]),
                pair=" ".join([*pre, "$A", *post, *pre, "$B:1", *post]),
                special_tokens=list(ids.items()),
            )
        )
    if steps:
        tok.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)


def spm_model_proto(model: GGUFModel, vocab: Vocab) -> bytes:
    """A SentencePiece ``tokenizer.model`` (BPE, byte fallback) from the GGUF vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    proto = spm.ModelProto()
    for text, score, kind in zip(vocab.tokens, vocab.scores or [], vocab.types, strict=True):
        piece = proto.pieces.add()
        # llama.cpp stores user-defined pieces "pre-normalized" (U+2581 -> space) because it
        # matches them in raw text; SentencePiece matches them after escaping spaces.
        piece.piece = text.replace(" ", "▁") if kind == TOKEN_USER_DEFINED else text
        piece.score = score
        piece.type = kind if kind in range(1, 7) else TOKEN_NORMAL
    spec = proto.trainer_spec
    spec.model_type = spm.TrainerSpec.BPE
    spec.vocab_size = len(vocab.tokens)
    spec.byte_fallback = True
    for what, attr in (("unknown", "unk_id"), ("bos", "bos_id"), ("eos", "eos_id"),
                       ("padding", "pad_id")):  # fmt: skip
        i = vocab.special_id(model, what)
        setattr(spec, attr, -1 if i is None else i)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(model.meta("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return proto.SerializeToString()


def tokenizer_config(model: GGUFModel, vocab: Vocab) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(model.meta("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(model.meta("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model.meta("{arch}.context_length", 4096)),
    }
    for what, key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"),
                      ("unknown", "unk_token")):  # fmt: skip
        if (text := vocab.special_text(model, what)) is not None:
            config[key] = text
    template = model.meta("tokenizer.chat_template", None)
    if template is None and model.arch == "gemma3" and "<start_of_turn>" in vocab.tokens:
        template = _GEMMA3_CHAT_TEMPLATE
    if template is not None:
        config["chat_template"] = str(template)
    return config


def write_tokenizer(model: GGUFModel, folder: Path) -> None:
    vocab = read_vocab(model)
    if vocab.kind == "gpt2":
        tok = build_bpe_tokenizer(model, vocab)
    elif vocab.kind == "llama":
        tok = build_spm_tokenizer(model, vocab)
        (folder / "tokenizer.model").write_bytes(spm_model_proto(model, vocab))
    else:
        raise ConversionError(f"{model.path}: unsupported tokenizer model {vocab.kind!r}")
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tokenizer_config(model, vocab))


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    src: str | Path,
    dst: str | Path,
    dtype: str = "float32",
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Convert the GGUF file ``src`` into the mlx-lm model folder ``dst``; return ``dst``.

    ``dtype`` is the stored weight dtype (float32 is the fast one on MLX's CPU backend).
    An existing ``dst`` is replaced only with ``force=True``. Raises :class:`ConversionError`.
    """
    dst = Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"{src}: unsupported dtype {dtype!r} (choose from {DTYPES})")
    if dst.exists() and not force:
        raise ConversionError(f"{dst} exists; pass --force")
    model = read_gguf(src)
    with atomic_folder(dst, force) as tmp:
        _convert_into(model, tmp, dtype, progress)
    return dst


def _convert_into(model: GGUFModel, folder: Path, dtype: str, progress: Progress | None) -> None:
    try:
        config = build_config(model)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"{model.path}: bad metadata: {_one_line(e)}") from e
    weights = load_weights(model, config, progress)
    check_shapes(model, config, weights)
    write_tokenizer(model, folder)
    _write_json(folder / "config.json", config)
    save_weights(weights, folder / "model.safetensors", dtype)


def main(argv: list[str] | None = None) -> int:
    """``python -m redrafter_mlx.conversion.gguf SRC DST [--dtype D] [--force]``."""
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = convert_gguf(args.src, args.dst, args.dtype, args.force)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":  # `python -m` imports redrafter_mlx (and a fast BLAS) first
    raise SystemExit(main())
