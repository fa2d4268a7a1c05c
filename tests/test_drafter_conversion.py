"""Converting Apple's PyTorch ReDrafter checkpoints to MLX.

Parity tests build a small PyTorch reference of Apple's drafter and beam search here (Apple's
names and semantics: ``lm_head`` Sequential of residual blocks, optional ``input_proj``,
``rnn_w``/``rnn_u``, initial beam scores ``[0, -50000, ...]``), save it the way Apple's
``save_pretrained`` and ``torch.save`` do, convert, and compare. Beam search runs without a warp
(``top_k=None`` on our side) and, in one case, with Apple's top-k warp on both sides (Apple
masks with -50000, we with -inf; the beams agree while ``width <= top_k``).

Bad-input tests write safetensors with MLX, so they run without PyTorch.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import sys
import warnings
from pathlib import Path

import redrafter_mlx.conversion.drafter as conv
from redrafter_mlx.beam_search import beam_search
from redrafter_mlx.conversion.drafter import (
    DrafterConversionError,
    DrafterConversionWarning,
    convert_drafter,
)
from redrafter_mlx.drafter import Drafter

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

V, H = 50, 16
APPLE_LOG_0 = -50000.0


@pytest.fixture
def torch():
    return pytest.importorskip(
        "torch", reason="PyTorch parity tests need torch (pip install torch==2.13.0)"
    )


# --------------------------------------------------------------------------------------------
# Apple-format checkpoints
# --------------------------------------------------------------------------------------------


def apple_config(
    vocab: int = V, hidden: int = H, exit_dim: int | None = None, layers: int = 2, rnn=True
) -> dict:
    """A config.json as Apple's ``DrafterConfig.save_pretrained`` writes it."""
    return {
        "architectures": ["Drafter"],
        "exit_dim": exit_dim or 2 * hidden,
        "hidden_size": hidden,
        "model_type": "recurrent_drafting_drafter",
        "num_draft_layers": layers,
        "num_lookback_tokens": -1,
        "rnn": rnn,
        "torch_dtype": "float32",
        "transformers_version": "4.44.2",
        "vocab_size": vocab,
    }


def apple_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under Apple's names, scaled for peaked draft distributions."""
    rng = np.random.default_rng(seed)
    hidden, exit_dim, layers = cfg["hidden_size"], cfg["exit_dim"], cfg["num_draft_layers"]

    def dense(rows: int, cols: int, gain: float = 1.5) -> np.ndarray:
        return (rng.normal(size=(rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (rng.normal(size=(n,)) * 0.1).astype(np.float32)

    w = {}
    if exit_dim != 2 * hidden:
        w["input_proj.weight"] = dense(exit_dim, 2 * hidden)
        w["input_proj.bias"] = bias(exit_dim)
    for i in range(layers):
        w[f"lm_head.{i}.linear.weight"] = dense(exit_dim, exit_dim)
        w[f"lm_head.{i}.linear.bias"] = bias(exit_dim)
    w[f"lm_head.{layers}.weight"] = dense(cfg["vocab_size"], exit_dim, gain=4.0)
    if cfg["rnn"]:
        w["rnn_w.weight"], w["rnn_u.weight"] = dense(hidden, hidden), dense(hidden, hidden)
        w["rnn_u.bias"] = bias(hidden)
    return w


def write_source(folder: Path, cfg: dict, weights: dict[str, np.ndarray]) -> Path:
    """An Apple-format folder whose model.safetensors is written by MLX (no torch needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    return folder


@pytest.fixture
def source(tmp_path) -> Path:
    cfg = apple_config()
    return write_source(tmp_path / "src", cfg, apple_weights(cfg))


def assert_only(tmp_path: Path, *names: str) -> None:
    """Nothing but ``names`` is left in ``tmp_path`` (no partial output, no temp folders)."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


# --------------------------------------------------------------------------------------------
# PyTorch reference (Apple's architecture and beam search)
# --------------------------------------------------------------------------------------------


def torch_reference(torch, cfg: dict, weights: dict[str, np.ndarray]):
    """Apple's drafter as a torch.nn module, loaded strictly from ``weights`` (float64)."""
    nn = torch.nn

    class ResBlock(nn.Module):
        def __init__(self, dim: int):
            super().__init__()
            self.linear = nn.Linear(dim, dim, bias=True)

        def forward(self, x):
            return x + nn.functional.silu(self.linear(x))

    class AppleDrafter(nn.Module):
        def __init__(self):
            super().__init__()
            hidden, exit_dim = cfg["hidden_size"], cfg["exit_dim"]
            if exit_dim != 2 * hidden:
                self.input_proj = nn.Linear(2 * hidden, exit_dim, bias=True)
            self.lm_head = nn.Sequential(
                *[ResBlock(exit_dim) for _ in range(cfg["num_draft_layers"])],
                nn.Linear(exit_dim, cfg["vocab_size"], bias=False),
            )
            if cfg["rnn"]:
                self.rnn_u = nn.Linear(hidden, hidden, bias=True)
                self.rnn_w = nn.Linear(hidden, hidden, bias=False)

        def step(self, state, emb):
            if cfg["rnn"]:
                return nn.functional.silu(self.rnn_w(emb) + self.rnn_u(state))
            return state + emb

        def logits(self, context, state):
            x = torch.cat([context, state], dim=-1)
            if hasattr(self, "input_proj"):
                x = self.input_proj(x)
            return self.lm_head(x)

    model = AppleDrafter()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model.double().eval()


def torch_teacher_forced(torch, ref, h: np.ndarray, emb: np.ndarray) -> np.ndarray:
    """[B, T, V] logits: s_0 = 0, s_t = step(s_{t-1}, E(tok_t)), logits(h, s_t)."""
    h_t, emb_t = torch.from_numpy(h).double(), torch.from_numpy(emb).double()
    state = torch.zeros_like(h_t)
    out = []
    with torch.no_grad():
        for t in range(emb.shape[1]):
            state = ref.step(state, emb_t[:, t])
            out.append(ref.logits(h_t, state))
    return torch.stack(out, dim=1).numpy()


def torch_beam_search(torch, ref, table: np.ndarray, h: np.ndarray, g0: int, W: int, L: int, k):
    """Apple's beam search: top-W of beam log-prob + log-softmax over all W * V candidates."""
    table_t = torch.from_numpy(table).double()
    context = torch.from_numpy(h).double().expand(W, -1)
    log_p_beam = torch.tensor([0.0] + [APPLE_LOG_0] * (W - 1), dtype=torch.float64)
    beams = torch.full((W, 1), g0, dtype=torch.long)
    state = torch.zeros(W, h.shape[-1], dtype=torch.float64)
    with torch.no_grad():
        for _ in range(L - 1):
            state = ref.step(state, table_t[beams[:, -1]])
            logits = ref.logits(context, state)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            if k is not None:  # Apple's warp_logits
                kth = torch.topk(logits, k).values[..., -1:]
                logits = logits.masked_fill(logits < kth, APPLE_LOG_0)
            log_p = logits.log_softmax(dim=-1)
            joint = (log_p + log_p_beam[:, None]).reshape(-1)
            log_p_beam, idx = torch.topk(joint, W)
            parent, token = idx // log_p.shape[-1], idx % log_p.shape[-1]
            beams = torch.cat([beams[parent], token[:, None]], dim=1)
            state = state[parent]
    return beams.numpy(), log_p_beam.numpy()


# --------------------------------------------------------------------------------------------
# Parity with the PyTorch reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rnn,exit_dim,fmt",
    [
        (True, None, "safetensors"),
        (False, None, "bin"),
        (True, 24, "bin"),
        (False, 40, "safetensors"),
    ],
)
def test_converted_drafter_matches_torch_reference(tmp_path, torch, rnn, exit_dim, fmt):
    from safetensors.torch import save_file

    cfg = apple_config(exit_dim=exit_dim, rnn=rnn)
    weights = apple_weights(cfg, seed=int(rnn) + (exit_dim or 0))
    ref = torch_reference(torch, cfg, weights)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    state = {k: v.float().contiguous() for k, v in ref.state_dict().items()}
    if fmt == "safetensors":
        save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, src / "pytorch_model.bin")

    out = convert_drafter(src, tmp_path / "mlx", dtype="float32")
    drafter = Drafter.from_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["rnn"] is rnn and saved["exit_dim"] == cfg["exit_dim"]
    assert saved["num_lookback_tokens"] == -1  # Apple's extra field is kept
    assert "torch_dtype" not in saved and "architectures" not in saved
    assert drafter.dtype == mx.float32

    rng = np.random.default_rng(7)
    h = rng.normal(size=(3, H)).astype(np.float32)
    emb = rng.normal(size=(3, 5, H)).astype(np.float32)
    got = np.array(drafter(mx.array(h), mx.array(emb)))
    want = torch_teacher_forced(torch, ref, h, emb)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    table = rng.normal(size=(V, H)).astype(np.float32)
    table_mx = mx.array(table)
    for W, L, k in [(1, 2, None), (3, 4, None), (6, 5, None), (10, 3, None), (4, 4, 6)]:
        ours = beam_search(drafter, lambda t: table_mx[t], mx.array(h[0]), mx.array(3), W, L, k)
        tokens, scores = torch_beam_search(torch, ref, table, h[0], 3, W, L, k)
        np.testing.assert_array_equal(np.array(ours.tokens), tokens, err_msg=f"W={W} L={L}")
        np.testing.assert_allclose(np.array(ours.scores), scores, rtol=1e-4, atol=1e-4)


def test_bfloat16_source_and_output_dtypes(tmp_path, torch):
    from safetensors.torch import save_file

    cfg = apple_config()
    weights = apple_weights(cfg)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in weights.items()}
    save_file(bf16, str(src / "model.safetensors"))
    torch.save(bf16, src / "model.pt")

    f32 = Drafter.from_pretrained(convert_drafter(src, tmp_path / "f32", dtype="float32"))
    for k, v in tree_flatten(f32.parameters()):
        np.testing.assert_array_equal(np.array(v), bf16[k].float().numpy(), err_msg=k)
    for dtype in ("float16", "bfloat16"):
        d = Drafter.from_pretrained(convert_drafter(src / "model.pt", tmp_path / dtype, dtype))
        assert d.dtype == getattr(mx, dtype)
        np.testing.assert_allclose(
            np.array(d.lm_head[-1].weight.astype(mx.float32)),
            bf16["lm_head.2.weight"].float().numpy(),
            rtol=1e-2,
        )


# --------------------------------------------------------------------------------------------
# Accepted inputs
# --------------------------------------------------------------------------------------------


def _converted(src: Path, dst: Path) -> dict[str, np.ndarray]:
    d = Drafter.from_pretrained(convert_drafter(src, dst, dtype="float32"))
    return {k: np.array(v) for k, v in tree_flatten(d.parameters())}


@pytest.mark.parametrize(
    "rename",
    [
        lambda k: k.replace("lm_head.", "lm_heads.").replace("input_proj.", "input_projs."),
        lambda k: k.replace("lm_head.", "lm_heads.0.").replace("input_proj.", "input_projs.0."),
        lambda k: k.replace("lm_head.", "0."),
        lambda k: "module." + k,
    ],
    ids=["plural", "head-list", "bare-head-list", "ddp-prefix"],
)
def test_tensorrt_llm_spellings(tmp_path, rename):
    cfg = apple_config(exit_dim=24)
    weights = apple_weights(cfg)
    want = _converted(write_source(tmp_path / "apple", cfg, weights), tmp_path / "a")
    renamed = {rename(k): v for k, v in weights.items()}
    assert renamed.keys() != weights.keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every renamed key is recognised
        got = _converted(write_source(tmp_path / "trt", cfg, renamed), tmp_path / "b")
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_several_heads_are_refused(tmp_path):
    cfg = apple_config()
    w = {k.replace("lm_head.", "lm_heads.0."): v for k, v in apple_weights(cfg).items()}
    w["lm_heads.1.2.weight"] = w["lm_heads.0.2.weight"]
    write_source(tmp_path / "src", cfg, w)
    with pytest.raises(DrafterConversionError, match=r"lm_heads\.1\.2\.weight belongs to head 1"):
        convert_drafter(tmp_path / "src", tmp_path / "out")
    assert_only(tmp_path, "src")


def test_single_weights_file_and_rnn_default(tmp_path):
    cfg = apple_config(rnn=False)
    del cfg["rnn"]  # Apple's DrafterConfig defaults rnn to False
    write_source(tmp_path / "src", cfg, apple_weights({**cfg, "rnn": False}))
    out = convert_drafter(tmp_path / "src" / "model.safetensors", tmp_path / "out")
    d = Drafter.from_pretrained(out)
    assert d.config.rnn is False and d.dtype == mx.float16
    assert "rnn_w" not in d


def test_emb_norm_is_dropped_quietly(tmp_path):
    cfg = apple_config()
    w = apple_weights(cfg) | {"emb_norm.weight": np.ones(H, np.float32)}
    write_source(tmp_path / "src", cfg, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Drafter.from_pretrained(convert_drafter(tmp_path / "src", tmp_path / "out"))


def test_llm_match_and_cli(tmp_path, source, capsys):
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": H, "vocab_size": V})
    )
    assert conv.main([str(source), str(tmp_path / "out"), "--llm", str(llm)]) == 0
    assert Drafter.from_pretrained(tmp_path / "out").config.hidden_size == H
    assert conv.main([str(source), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists; pass" in err


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_missing_config(tmp_path, source):
    (source / "config.json").unlink()
    with pytest.raises(DrafterConversionError, match=r"src/config\.json: not found"):
        convert_drafter(source, tmp_path / "out")
    with pytest.raises(DrafterConversionError, match="no such file or folder"):
        convert_drafter(tmp_path / "nope", tmp_path / "out")
    assert_only(tmp_path, "src")


def test_missing_weights(tmp_path, source):
    (source / "model.safetensors").unlink()
    with pytest.raises(DrafterConversionError, match=r"src: no drafter weights found"):
        convert_drafter(source, tmp_path / "out")
    (source / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(DrafterConversionError, match="sharded checkpoints are not supported"):
        convert_drafter(source, tmp_path / "out")
    assert_only(tmp_path, "src")


NOT_SAFETENSORS = r"model\.safetensors: not a valid safetensors file"


def test_truncated_safetensors(tmp_path, source):
    path = source / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(DrafterConversionError, match=NOT_SAFETENSORS):
        convert_drafter(source, tmp_path / "out")
    path.write_bytes(data[:20])  # cut inside the header
    with pytest.raises(DrafterConversionError, match=NOT_SAFETENSORS):
        convert_drafter(source, tmp_path / "out")
    assert_only(tmp_path, "src")


def test_wrong_shape(tmp_path):
    cfg = apple_config()
    w = apple_weights(cfg)
    w["lm_head.2.weight"] = np.zeros((V + 1, 2 * H), np.float32)
    write_source(tmp_path / "src", cfg, w)
    with pytest.raises(
        DrafterConversionError,
        match=r"lm_head\.2\.weight has shape \(51, 32\), expected \(50, 32\) from config\.json",
    ) as e:
        convert_drafter(tmp_path / "src", tmp_path / "out")
    assert "\n" not in str(e.value)
    assert_only(tmp_path, "src")


def test_missing_key(tmp_path):
    cfg = apple_config()
    w = apple_weights(cfg)
    del w["rnn_u.bias"]
    write_source(tmp_path / "src", cfg, w)
    with pytest.raises(DrafterConversionError, match=r"missing tensor\(s\) rnn_u\.bias"):
        convert_drafter(tmp_path / "src", tmp_path / "out")
    assert_only(tmp_path, "src")


def test_unknown_key_warns_or_fails_when_strict(tmp_path):
    cfg = apple_config()
    w = apple_weights(cfg) | {"medusa.weight": np.zeros(3, np.float32)}
    write_source(tmp_path / "src", cfg, w)
    with pytest.raises(DrafterConversionError, match="not used by a drafter.*medusa.weight"):
        convert_drafter(tmp_path / "src", tmp_path / "out", strict=True)
    assert_only(tmp_path, "src")
    with pytest.warns(DrafterConversionWarning, match=r"1 tensor\(s\) not used.*medusa\.weight"):
        out = convert_drafter(tmp_path / "src", tmp_path / "out")
    Drafter.from_pretrained(out)


def test_tensors_the_config_does_not_use_are_reported(tmp_path):
    cfg = apple_config(rnn=True)
    w = apple_weights(cfg)
    write_source(tmp_path / "src", {**cfg, "rnn": False}, w)  # config and weights disagree
    with pytest.warns(DrafterConversionWarning, match="rnn false.*rnn_w.weight"):
        convert_drafter(tmp_path / "src", tmp_path / "out")


def test_llm_mismatch(tmp_path, source):
    llm = tmp_path / "llm"
    llm.mkdir()
    for dims, message in [
        ({"hidden_size": 2 * H, "vocab_size": V}, f"hidden_size {H} does not match the LLM's 32"),
        ({"hidden_size": H, "vocab_size": V + 1}, f"vocab_size {V} does not match the LLM's 51"),
    ]:
        (llm / "config.json").write_text(json.dumps({"model_type": "qwen2", **dims}))
        with pytest.raises(DrafterConversionError, match=message):
            convert_drafter(source, tmp_path / "out", llm=llm)
    with pytest.raises(DrafterConversionError, match="LLM config not found"):
        convert_drafter(source, tmp_path / "out", llm=tmp_path / "no-llm")
    assert_only(tmp_path, "src", "llm")


def test_bad_config(tmp_path, source):
    cfg = json.loads((source / "config.json").read_text())
    for bad, message in [
        ({k: v for k, v in cfg.items() if k != "exit_dim"}, r"missing drafter field\(s\) exit_dim"),
        ({**cfg, "model_type": "llama"}, "model_type 'llama' is not a ReDrafter drafter"),
        ({**cfg, "exit_dim": -1}, "exit_dim must be a positive integer"),
        ({**cfg, "rnn": "yes"}, "rnn must be true or false"),
    ]:
        (source / "config.json").write_text(json.dumps(bad))
        with pytest.raises(DrafterConversionError, match=message):
            convert_drafter(source, tmp_path / "out")
    (source / "config.json").write_text("{not json")
    with pytest.raises(DrafterConversionError, match="not a readable JSON config"):
        convert_drafter(source, tmp_path / "out")
    assert_only(tmp_path, "src")


def test_float16_overflow(tmp_path):
    cfg = apple_config()
    w = apple_weights(cfg)
    w["rnn_w.weight"][0, 0] = 1e6
    write_source(tmp_path / "src", cfg, w)
    with pytest.raises(DrafterConversionError, match="rnn_w.weight overflows"):
        convert_drafter(tmp_path / "src", tmp_path / "out", dtype="float16")
    assert_only(tmp_path, "src")
    convert_drafter(tmp_path / "src", tmp_path / "out", dtype="bfloat16")


class _Payload:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_malicious_pickle_is_refused_and_not_run(tmp_path, torch, legacy):
    cfg = apple_config()
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "pwned"
    state = {k: torch.from_numpy(v) for k, v in apple_weights(cfg).items()}
    state["rnn_u.bias"] = _Payload(marker)
    path = src / "pytorch_model.bin"
    if legacy:
        with path.open("wb") as f:
            pickle.dump(state, f)
    else:
        torch.save(state, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on pickle protocols
        with pytest.raises(DrafterConversionError, match=r"pytorch_model\.bin: refused.*code exec"):
            convert_drafter(src, tmp_path / "out")
    assert not marker.exists()
    assert_only(tmp_path, "src")
    # Control: the payload is real. An unsafe load runs it (a harmless `touch`).
    with path.open("rb") as f:
        pickle.load(f) if legacy else torch.load(f, weights_only=False)
    assert marker.exists()


def test_corrupt_pickle(tmp_path, torch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(apple_config()))
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DrafterConversionError, match="not a readable PyTorch checkpoint"):
        convert_drafter(src, tmp_path / "out")
    torch.save({"model": {"x": 1}}, src / "pytorch_model.bin")
    with pytest.raises(DrafterConversionError, match="does not hold a state dict of tensors"):
        convert_drafter(src, tmp_path / "out")


def test_without_torch(tmp_path, source, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    Drafter.from_pretrained(convert_drafter(source, tmp_path / "st"))  # safetensors: no torch
    (source / "model.safetensors").unlink()
    (source / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(DrafterConversionError, match=r"pip install torch==2\.13\.0"):
        convert_drafter(source, tmp_path / "bin")


def test_destination_exists(tmp_path, source):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("keep me")
    with pytest.raises(DrafterConversionError, match="out exists; pass force"):
        convert_drafter(source, dst)
    assert (dst / "old.txt").read_text() == "keep me"
    convert_drafter(source, dst, force=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(DrafterConversionError, match="destination holds the source"):
        convert_drafter(source, source, force=True)
    assert_only(tmp_path, "src", "out")


def test_failed_write_leaves_nothing_behind(tmp_path, source, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("keep me")
    monkeypatch.setattr(conv.mx, "save_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_drafter(source, dst, force=True)
    assert sorted(p.name for p in dst.iterdir()) == ["old.txt"]  # the old folder is untouched
    assert_only(tmp_path, "src", "out")
