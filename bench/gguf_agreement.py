"""Top-1 next-token agreement between llama.cpp (on a GGUF) and its MLX conversion.

llama.cpp is the independent reference: it runs the GGUF file itself, with the quantized
weights, while the MLX model holds the dequantized float32 weights. Both get the same token
ids (Python standard-library source tokenized by the converted tokenizer), and we compare the
argmax at every position. The tokenizers are compared too (same text, same ids?).

llama-cpp-python lives in a separate venv, so this script runs twice: in the MLX venv (the
driver) and, as a subprocess with ``--worker``, in the llama.cpp venv.

    python bench/gguf_agreement.py --gguf MODEL.gguf --mlx CONVERTED_DIR --out result.json \\
        [--llama-python /work/llamacpp-venv/bin/python] [--positions 300]
    python bench/gguf_agreement.py --synthetic --out result.json   # tiny llama/qwen2/gemma3

``--synthetic`` writes tiny random GGUFs (float32 weights, llama.cpp's Q/K layout for llama),
converts them and compares full logits with llama.cpp: it checks the conversion's tensor
mapping, including the llama Q/K un-permutation, against llama.cpp's own kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_LLAMA_PYTHON = "/work/llamacpp-venv/bin/python"
#: Standard-library modules whose source is the text (one window of tokens from each).
SOURCES = ("textwrap", "heapq", "bisect", "fractions", "shlex", "difflib")


# --------------------------------------------------------------------------------------------
# Worker: runs inside the llama.cpp venv (no mlx here)
# --------------------------------------------------------------------------------------------


def worker(job_path: str) -> None:
    """Read a job JSON, run llama.cpp, write the answer JSON next to it."""
    import llama_cpp
    import numpy as np

    job = json.loads(Path(job_path).read_text())
    llm = llama_cpp.Llama(
        job["gguf"], n_ctx=job["n_ctx"], logits_all=True, n_threads=os.cpu_count(),
        n_batch=job["n_ctx"], verbose=False,
    )  # fmt: skip
    answer: dict[str, Any] = {"llama_cpp_version": llama_cpp.__version__, "windows": []}
    for ids in job["windows"]:
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)  # (positions, vocab)
        top5 = np.argsort(-scores, axis=1)[:, :5]
        window = {
            "top5": top5.tolist(),
            "top5_logits": np.take_along_axis(scores, top5, axis=1).tolist(),
        }
        if job.get("full_logits"):
            window["logits"] = scores.tolist()
        answer["windows"].append(window)
    answer["tokenized"] = [
        llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) for text in job["texts"]
    ]
    Path(job["answer"]).write_text(json.dumps(answer))


def run_llama_cpp(llama_python: str, job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        job = job | {"answer": str(Path(tmp) / "answer.json")}
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        subprocess.run([llama_python, __file__, "--worker", str(job_path)], check=True)
        return json.loads(Path(job["answer"]).read_text())


# --------------------------------------------------------------------------------------------
# Driver: MLX side
# --------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    import mlx.core as mx
    import numpy as np
    import tokenizers

    mem = ""
    if Path("/proc/meminfo").exists():
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":")[1].strip()
    import redrafter_mlx._blas as blas
    from redrafter_mlx.benchmark import chip

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": chip(),
        "cpu_count": os.cpu_count(),
        "memory": mem,
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_device": str(mx.default_device()),
        "mlx_lm": version("mlx-lm"),
        "gguf": version("gguf"),
        "numpy": np.__version__,
        "tokenizers": tokenizers.__version__,
        "openblas": blas.status,
    }


def source_text(name: str) -> str:
    import importlib
    import inspect

    return inspect.getsource(importlib.import_module(name))


def mlx_top5(model: Any, ids: list[int]) -> tuple[Any, Any]:
    """(top-5 ids, full logits) of the MLX model at every position: shapes (L, 5), (L, V)."""
    import mlx.core as mx
    import numpy as np

    logits = model(mx.array([ids]))[0].astype(mx.float32)  # (L, V)
    mx.eval(logits)
    scores = np.array(logits)
    return np.argsort(-scores, axis=1)[:, :5], scores


def agreement(mlx_top: Any, ref_top: list[list[int]]) -> dict[str, Any]:
    import numpy as np

    ref = np.asarray(ref_top)
    top1 = mlx_top[:, 0] == ref[:, 0]
    in5 = np.array([r[0] in m for m, r in zip(mlx_top, ref, strict=True)])
    return {"positions": int(len(top1)), "top1_agree": int(top1.sum()), "in_top5": int(in5.sum())}


def disagreement_margins(mlx_top: Any, scores: Any, window: dict) -> list[dict[str, float]]:
    """Where the top-1 differ: how far apart the two candidates are on each side (logits).

    Near-ties on both sides point at quantization noise rather than a conversion error.
    """
    out = []
    for pos, (mine, ref) in enumerate(zip(mlx_top[:, 0], window["top5"], strict=True)):
        theirs = ref[0]
        if mine == theirs:
            continue
        item = {"position": pos, "mlx_margin": float(scores[pos, mine] - scores[pos, theirs])}
        if int(mine) in ref:
            logits = window["top5_logits"][pos]
            item["llama_cpp_margin"] = float(logits[0] - logits[ref.index(int(mine))])
        out.append(item)
    return out


def real_model(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from mlx_lm import load

    model, tok = load(str(args.mlx))
    per_window = max(1, args.positions // len(SOURCES))
    texts = [source_text(name) for name in SOURCES]
    windows = [tok.encode(t, add_special_tokens=False)[:per_window] for t in texts]
    bos = _adds_bos(tok)
    if bos is not None:
        windows = [[bos, *w[: per_window - 1]] for w in windows]
    start = time.perf_counter()
    answer = run_llama_cpp(
        args.llama_python,
        {"gguf": str(args.gguf), "n_ctx": per_window + 8, "windows": windows, "texts": texts},
    )
    llama_s = time.perf_counter() - start
    start = time.perf_counter()
    counts, margins, diffs = [], [], []
    for ids, window in zip(windows, answer["windows"], strict=True):
        top, scores = mlx_top5(model, ids)
        counts.append(agreement(top, window["top5"]))
        margins += disagreement_margins(top, scores, window)
        # the same five tokens' logits on both sides: (positions, 5)
        mine = np.take_along_axis(scores, np.asarray(window["top5"]), axis=1)
        diffs.append(np.abs(mine - np.asarray(window["top5_logits"])).ravel())
    mlx_s = time.perf_counter() - start
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    same_tokens = [
        tok.encode(t, add_special_tokens=False) == ref
        for t, ref in zip(texts, answer["tokenized"], strict=True)
    ]
    return {
        "gguf": str(args.gguf),
        "mlx_model": str(args.mlx),
        "sources": list(SOURCES),
        "per_source": dict(zip(SOURCES, counts, strict=True)),
        **total,
        "top1_agreement_pct": round(100 * total["top1_agree"] / total["positions"], 2),
        "llama_top1_in_mlx_top5_pct": round(100 * total["in_top5"] / total["positions"], 2),
        "disagreement_margins": margins,
        "top5_logit_abs_diff_mean": round(float(np.concatenate(diffs).mean()), 4),
        "top5_logit_abs_diff_max": round(float(np.concatenate(diffs).max()), 4),
        "top1_logit_mean": round(
            float(
                np.mean(
                    [
                        w["top5_logits"][p][0]
                        for w in answer["windows"]
                        for p in range(len(w["top5"]))
                    ]
                )
            ),
            3,
        ),
        "tokenizer_identical_on_sources": sum(same_tokens),
        "tokenizer_sources": len(same_tokens),
        "llama_cpp_version": answer["llama_cpp_version"],
        "llama_cpp_seconds": round(llama_s, 1),
        "mlx_seconds": round(mlx_s, 1),
    }


def write_f32_copy(src: Path, dst: Path) -> None:
    """The same GGUF with every tensor dequantized to float32 (same metadata otherwise).

    llama.cpp on this copy computes with the very weights the MLX conversion holds, so any
    remaining disagreement is arithmetic, not quantization or a mapping error.
    """
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = str(reader.get_field("general.architecture").contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        if key == "general.file_type":
            w.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def f32_reference(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """Re-run the comparison against llama.cpp on a float32 copy of the GGUF."""
    with tempfile.TemporaryDirectory(dir=args.gguf.parent) as tmp:
        copy = Path(tmp) / "f32.gguf"
        write_f32_copy(args.gguf, copy)
        sub = argparse.Namespace(**{**vars(args), "gguf": copy})
        ref = real_model(sub)
    keys = ("top1_agreement_pct", "llama_top1_in_mlx_top5_pct", "top5_logit_abs_diff_mean",
            "top5_logit_abs_diff_max", "positions", "top1_agree")  # fmt: skip
    return {k: ref[k] for k in keys} | {"disagreement_margins": ref["disagreement_margins"]}


def _adds_bos(tok: Any) -> int | None:
    ids = tok.encode("x")
    return ids[0] if len(ids) > 1 and ids[0] == tok.bos_token_id else None


# --------------------------------------------------------------------------------------------
# Synthetic models: conversion vs llama.cpp on full logits
# --------------------------------------------------------------------------------------------


def synthetic(args: argparse.Namespace) -> dict[str, Any]:
    from redrafter_mlx.conversion import convert_gguf

    import numpy as np
    from mlx_lm import load

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2", "gemma3"):
            path = Path(tmp) / f"{arch}.gguf"
            write_synthetic(path, arch)
            out = convert_gguf(path, Path(tmp) / arch)
            model, tok = load(str(out))
            rng = np.random.default_rng(1)
            ids = [int(i) for i in rng.integers(300, 330, size=24)]
            answer = run_llama_cpp(
                args.llama_python,
                {"gguf": str(path), "n_ctx": 64, "windows": [ids], "texts": [],
                 "full_logits": True},
            )  # fmt: skip
            top, scores = mlx_top5(model, ids)
            ref = np.asarray(answer["windows"][0]["logits"], dtype=np.float32)
            counts = agreement(top, answer["windows"][0]["top5"])
            results[arch] = {
                **counts,
                "max_abs_logit_diff": float(np.abs(scores - ref).max()),
                "logit_scale": float(np.abs(ref).max()),
            }
            if arch == "llama":  # control: the stored (permuted) Q/K rows, not un-permuted
                _repermute_qk(model)
                top, scores = mlx_top5(model, ids)
                results[arch]["control_without_unpermute"] = {
                    **agreement(top, answer["windows"][0]["top5"]),
                    "max_abs_logit_diff": float(np.abs(scores - ref).max()),
                }
            print(arch, results[arch], flush=True)
        results["llama_cpp_version"] = answer["llama_cpp_version"]
    return results


def _repermute_qk(model: Any) -> None:
    """Put llama.cpp's Q/K row order back into a converted llama model (the control)."""
    import mlx.core as mx
    import numpy as np

    for layer in model.model.layers:
        attn = layer.self_attn
        for proj, heads in ((attn.q_proj, attn.n_heads), (attn.k_proj, attn.n_kv_heads)):
            proj.weight = mx.array(_permute(np.array(proj.weight), heads))


def write_synthetic(path: Path, arch: str) -> None:
    """A tiny random float32 GGUF laid out as llama.cpp's converter writes it."""
    import gguf
    import numpy as np

    hidden, ffn, heads, kv_heads, head_dim = 128, 256, 4, 2, 32
    layers = 6 if arch == "gemma3" else 2  # gemma3: one full sliding-window period (5 + 1)
    rng = np.random.default_rng({"llama": 0, "qwen2": 1, "gemma3": 2}[arch])

    def mat(rows: int, cols: int) -> Any:
        return rng.normal(0, 1.0 / np.sqrt(cols), (rows, cols)).astype(np.float32) * 2

    def vec(n: int, mean: float = 1.0) -> Any:
        return rng.normal(mean, 0.1, n).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma3":
        w.add_sliding_window(8)
    vocab = _synthetic_vocab(w, arch)
    tensors = {"token_embd.weight": mat(vocab, hidden), "output_norm.weight": vec(hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        q, k = mat(heads * head_dim, hidden), mat(kv_heads * head_dim, hidden)
        if arch == "llama":  # llama.cpp's converter: rotate-half rows -> interleaved pairs
            q, k = _permute(q, heads), _permute(k, kv_heads)
        tensors |= {
            b + "attn_q.weight": q, b + "attn_k.weight": k,
            b + "attn_v.weight": mat(kv_heads * head_dim, hidden),
            b + "attn_output.weight": mat(hidden, heads * head_dim),
            b + "attn_norm.weight": vec(hidden),
            b + "ffn_norm.weight": vec(hidden), b + "ffn_gate.weight": mat(ffn, hidden),
            b + "ffn_up.weight": mat(ffn, hidden), b + "ffn_down.weight": mat(hidden, ffn),
        }  # fmt: skip
        if arch == "qwen2":
            for part, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[f"{b}attn_{part}.bias"] = vec(rows * head_dim, 0.0)
        if arch == "gemma3":
            tensors |= {
                b + "attn_q_norm.weight": vec(head_dim), b + "attn_k_norm.weight": vec(head_dim),
                b + "post_attention_norm.weight": vec(hidden),
                b + "post_ffw_norm.weight": vec(hidden),
            }  # fmt: skip
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(w: Any, n_head: int) -> Any:
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
    )


def _synthetic_vocab(w: Any, arch: str) -> int:
    """Write a small vocabulary llama.cpp accepts; return its size."""
    if arch == "qwen2":
        keep = [*range(33, 127), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        extra = iter(range(256, 512))
        tokens = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
        tokens += [f"w{i}" for i in range(100)]
        merges = [f"w {i}" for i in range(10)]
        tokens += [f"w{i}" for i in range(10) if f"w{i}" not in tokens]
        tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        types = [1] * (len(tokens) - 3) + [3, 3, 3]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_merges(merges)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_add_bos_token(False)
    else:
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        types = [2, 3, 3] + [6] * 256
        pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", *[f"▁w{i}" for i in range(100)]]
        tokens += pieces
        types += [1] * len(pieces)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(arch != "gemma3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    return len(tokens)


# --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--mlx", type=Path, help="folder written by convert_gguf")
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--positions", type=int, default=300)
    parser.add_argument("--llama-python", default=DEFAULT_LLAMA_PYTHON)
    parser.add_argument(
        "--f32-reference", action="store_true",
        help="also compare with llama.cpp on a float32 (dequantized) copy of the GGUF",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    if args.out is None or not (args.synthetic or (args.gguf and args.mlx)):
        parser.error("give --out and either --synthetic or --gguf with --mlx")

    import redrafter_mlx  # noqa: F401  (a fast BLAS before mlx)

    info = machine_info()
    print(json.dumps(info, indent=1))
    result = synthetic(args) if args.synthetic else real_model(args)
    if args.f32_reference and not args.synthetic:
        result["vs_llama_cpp_on_f32_copy"] = f32_reference(args, result)
    result = {"kind": "synthetic" if args.synthetic else "real", **result, "machine": info}
    if not args.synthetic:
        print(
            f"top-1 agreement llama.cpp vs MLX: {result['top1_agreement_pct']}% "
            f"of {result['positions']} positions (llama.cpp top-1 in MLX top-5: "
            f"{result['llama_top1_in_mlx_top5_pct']}%); tokenizer identical on "
            f"{result['tokenizer_identical_on_sources']}/{result['tokenizer_sources']} sources"
        )
        print(f"|logit difference| on llama.cpp's top-5 tokens: mean "
              f"{result['top5_logit_abs_diff_mean']}, max {result['top5_logit_abs_diff_max']} "
              f"(mean top-1 logit {result['top1_logit_mean']})")  # fmt: skip
        gaps = [m["mlx_margin"] for m in result["disagreement_margins"]]
        if gaps:
            print(f"MLX logit margins at the {len(gaps)} disagreements: max {max(gaps):.3f}, "
                  f"median {sorted(gaps)[len(gaps) // 2]:.3f}")  # fmt: skip
        if ref := result.get("vs_llama_cpp_on_f32_copy"):
            print(f"vs llama.cpp on a float32 copy of the GGUF: top-1 agreement "
                  f"{ref['top1_agreement_pct']}%, |logit difference| on its top-5: mean "
                  f"{ref['top5_logit_abs_diff_mean']}, "
                  f"max {ref['top5_logit_abs_diff_max']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
