"""Tiny synthetic GGUF files (vocabularies, tensors, writer) shared by the tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 128, 4, 2, 16, 2
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "the cat sat on the mat",
    "def f(x):\n\treturn x  # tab and 🙂 emoji, é, 中文",
    "  two  spaces\n\nand lines",
]

# --------------------------------------------------------------------------------------------
# Synthetic vocabularies
# --------------------------------------------------------------------------------------------


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges): 256 byte symbols, a few merges, three control tokens."""
    tokens = byte_chars()
    merges = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "Ġ s", "Ġs at", "d e", "de f"]
    tokens += ["".join(m.split()) for m in merges]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    return tokens, types, merges


def spm_vocab(user_defined: bool = True) -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) of a tiny SentencePiece-BPE vocabulary, Gemma-style.

    Gemma has user-defined pieces (newlines, space runs); Llama 2 has none.
    """
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    # user-defined, stored pre-normalized ("▁" -> " ") like llama.cpp does
    tokens += ["\n", "  "] if user_defined else ["<unused0>", "<unused1>"]
    types += [4, 4] if user_defined else [5, 5]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    normal = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "at", "▁c", "▁cat", "▁s"]
    tokens += normal
    types += [1] * len(normal)
    scores = [-1000.0] * 8 + [0.0] * 256 + [-float(i) for i in range(len(normal))]
    return tokens, types, scores


# --------------------------------------------------------------------------------------------
# Synthetic GGUF writer
# --------------------------------------------------------------------------------------------


def hf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows (rotate-half -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def encode(w: np.ndarray, qtype: Q | None) -> tuple[np.ndarray, np.ndarray]:
    """(stored data, what a reader dequantizes it to); qtype None stores ``w`` as it is."""
    if qtype is None:
        return w, w.astype(np.float32)
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return data, gguf.quants.dequantize(data, qtype)


def layer_tensors(arch: str, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Q]]:
    """GGUF tensors of one synthetic model: name -> (float32 weights, storage type)."""

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 0.2, (rows, cols)).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return rng.normal(1, 0.1, (n,)).astype(np.float32)

    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out: dict[str, tuple[np.ndarray, Q]] = {"output_norm.weight": (vec(HIDDEN), Q.F32)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        out |= {
            b + "attn_q.weight": (mat(q_rows, HIDDEN), Q.Q8_0),
            b + "attn_k.weight": (mat(kv_rows, HIDDEN), Q.F16),
            b + "attn_v.weight": (mat(kv_rows, HIDDEN), Q.Q8_0),
            b + "attn_output.weight": (mat(HIDDEN, q_rows), Q.F32),
            b + "attn_norm.weight": (vec(HIDDEN), Q.F32),
            b + "ffn_norm.weight": (vec(HIDDEN), Q.F32),
            b + "ffn_gate.weight": (mat(FFN, HIDDEN), Q.Q8_0),
            b + "ffn_up.weight": (mat(FFN, HIDDEN), Q.F16),
            b + "ffn_down.weight": (mat(HIDDEN, FFN), Q.Q8_0),
        }
        if arch == "qwen2":
            out |= {
                b + "attn_q.bias": (rng.normal(0, 0.1, q_rows).astype(np.float32), Q.F32),
                b + "attn_k.bias": (rng.normal(0, 0.1, kv_rows).astype(np.float32), Q.F32),
                b + "attn_v.bias": (rng.normal(0, 0.1, kv_rows).astype(np.float32), Q.F32),
            }
        if arch == "gemma3":
            out |= {
                b + "attn_q_norm.weight": (vec(HEAD_DIM), Q.F32),
                b + "attn_k_norm.weight": (vec(HEAD_DIM), Q.F32),
                b + "post_attention_norm.weight": (vec(HIDDEN), Q.F32),
                b + "post_ffw_norm.weight": (vec(HIDDEN), Q.F32),
            }
    return out


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, Q]],
    vocab_kind: str,
    extra_meta: dict | None = None,
    ffn_length: int = FFN,
) -> dict[str, np.ndarray]:
    """Write a GGUF file; return name -> what a reader dequantizes each tensor to."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(16384)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(ffn_length)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if vocab_kind == "gpt2":
        tokens, types, merges = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    else:
        tokens, types, scores = spm_vocab(user_defined=arch == "gemma3")
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores(scores)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(arch != "gemma3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, value in (extra_meta or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (rng.normal(0, 0.2, (len(tokens), HIDDEN)), Q.F16)} | tensors
    decoded = {}
    for name, (array, qtype) in tensors.items():
        data, decoded[name] = encode(np.asarray(array), qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (None, Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded
