"""Distillation data: prompts from an offline corpus, answered by the LLM itself.

Sequence-level knowledge distillation trains the drafter on text the LLM generated (greedy),
so what the drafter learns to predict is exactly what verification will accept. Steps, each
cached in the data folder so an interrupted run picks up where it stopped:

1. prompts (``prompts.jsonl``): Python standard-library functions, as raw completions
   (signature + docstring, the LLM writes the body) and as chat requests; or a user JSONL of
   ``{"prompt": ...}`` / ``{"text": ...}`` lines;
2. generations (``generations.jsonl``): the LLM's greedy answers, in batches;
3. hidden states (``hidden-*.safetensors``): the LLM's final hidden state at every answer
   position, recomputed in one teacher-forced forward per batch.

HumanEval is the benchmark and is never used here.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapters import adapter_for

CHAT_REQUEST = "Write the Python function below. Reply with code only.\n\n```python\n{}\n```"


@dataclass
class Sample:
    prompt: list[int]
    answer: list[int]


# -- prompts ------------------------------------------------------------------------------------


def stdlib_functions(limit_files: int | None = None) -> Iterator[str]:
    """Signature + docstring of documented functions in the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.parts))
    for path in files[:limit_files]:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            body = node.body
            if not doc or len(doc) < 20 or len(body) < 2 or not isinstance(body[0], ast.Expr):
                continue
            head = lines[node.lineno - 1 : body[0].end_lineno]
            indent = len(head[0]) - len(head[0].lstrip())
            yield "\n".join(line[indent:] for line in head)


def build_prompts(tokenizer, n: int, seed: int = 0, chat_share: float = 0.5) -> list[list[int]]:
    """``n`` distinct prompts from the standard library, shuffled with ``seed``."""
    snippets = sorted(set(stdlib_functions()))
    random.Random(seed).shuffle(snippets)
    prompts = []
    for i, snippet in enumerate(snippets[:n]):
        if tokenizer.chat_template is not None and i % 2 == 0 and chat_share > 0:
            content = CHAT_REQUEST.format(snippet)
            prompts.append(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}], add_generation_prompt=True
                )
            )
        else:
            prompts.append(tokenizer.encode(snippet + "\n"))
    if len(prompts) < n:
        raise ValueError(f"the standard library gave only {len(prompts)} prompts, {n} asked")
    return prompts


def read_jsonl_prompts(path: str | Path, tokenizer) -> list[list[int]]:
    """A user's JSONL: ``{"prompt": str}`` lines (answered by the LLM) or ``{"text": str}``."""
    prompts = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row.get("prompt", row.get("text"))
        except (json.JSONDecodeError, AttributeError):
            text = None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{i}: expected a JSON object with a 'prompt' or 'text' string")
        prompts.append(tokenizer.encode(text))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# -- generation ---------------------------------------------------------------------------------


def generate_answers(
    model: nn.Module,
    tokenizer,
    prompts: list[list[int]],
    path: Path,
    max_tokens: int = 192,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """Greedy answers for ``prompts``, appended to ``path`` batch by batch (resumable)."""
    from mlx_lm.generate import batch_generate

    done = read_samples(path) if path.exists() else []
    if done and [s.prompt for s in done] != prompts[: len(done)]:
        raise ValueError(f"{path}: cached generations belong to other prompts; use a new folder")
    with path.open("a") as f:
        for start in range(len(done), len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            out = batch_generate(
                model,
                tokenizer,
                batch,
                max_tokens=max_tokens,
                return_token_ids=True,
                completion_batch_size=batch_size,
                prefill_batch_size=batch_size,
            )
            for prompt, answer in zip(batch, out.token_ids, strict=True):
                done.append(Sample(prompt, list(answer)))
                f.write(json.dumps({"prompt": prompt, "answer": list(answer)}) + "\n")
            f.flush()
            if progress:
                progress(len(done), len(prompts))
    return done


def read_samples(path: Path) -> list[Sample]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Sample(r["prompt"], r["answer"]) for r in rows]


# -- hidden states ------------------------------------------------------------------------------


def answer_hidden_states(model: nn.Module, samples: list[Sample]) -> list[mx.array]:
    """For each sample, [len(answer), H]: row j is the state that produced answer[j].

    Right-padding a batch is harmless in a causal model: padding comes after every real token.
    """
    adapter = adapter_for(model)
    seqs = [s.prompt + s.answer[:-1] for s in samples]
    T = max(len(q) for q in seqs)
    ids = mx.array([q + [0] * (T - len(q)) for q in seqs], dtype=mx.int32)
    hidden = adapter.hidden_states(model, ids, cache=None)  # [B, T, H]
    out = []
    for b, s in enumerate(samples):
        start = len(s.prompt) - 1
        out.append(hidden[b, start : start + len(s.answer)])
    return out


def cache_hidden_states(
    model: nn.Module,
    samples: list[Sample],
    folder: Path,
    batch_tokens: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write the answers' hidden states (float16) in shards of about ``batch_tokens`` tokens."""
    shards, batch, index = [], [], 0
    length = [len(s.prompt) + len(s.answer) for s in samples]
    order = sorted(range(len(samples)), key=length.__getitem__)

    def flush() -> None:
        nonlocal batch, index
        path = folder / f"hidden-{index:05d}.safetensors"
        if not path.exists():
            states = answer_hidden_states(model, [samples[i] for i in batch])
            arrays = {f"{i}": h.astype(mx.float16) for i, h in zip(batch, states, strict=True)}
            tmp = path.with_suffix(".tmp.safetensors")
            mx.save_safetensors(str(tmp), arrays)
            tmp.rename(path)
        shards.append(path)
        index += 1
        batch = []
        if progress:
            progress(sum(1 for _ in shards), -1)

    tokens = 0
    for i in order:
        if not samples[i].answer:
            continue
        n = length[i]
        if batch and (len(batch) + 1) * max(n, tokens) > batch_tokens:
            flush()
        batch.append(i)
        tokens = n
    if batch:
        flush()
    return shards


def load_hidden_states(shards: list[Path]) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for path in shards:
        for key, value in mx.load(str(path)).items():
            out[int(key)] = np.array(value)
    return out
