"""Distillation data: prompts from an offline corpus, answered by the LLM itself.

Sequence-level knowledge distillation trains the drafter on text the LLM generated (greedy),
so what the drafter learns to predict is exactly what verification will accept. Both steps
are cached in the data folder, so an interrupted run picks up where it stopped:

1. prompts (``prompts.jsonl``): Python standard-library functions, as raw completions
   (signature + docstring, the LLM writes the body) and as chat requests; or a user JSONL of
   ``{"prompt": ...}`` / ``{"text": ...}`` lines;
2. answers (``generations.jsonl``): the LLM's greedy answers, in batches, and with them
   (``hidden-*.safetensors``) the final hidden state that produced every answer token, kept
   during generation so no second forward pass is needed.

HumanEval is the benchmark and is never used here.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import sysconfig
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .adapters import adapter_for
from .verification import SamplingParams, node_targets

GROUP_BATCHES = 8  # batches whose prompts are sorted by length together

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


@functools.cache
def _stdlib_snippets() -> tuple[str, ...]:
    return tuple(sorted(set(stdlib_functions())))


def stdlib_snippets(n: int, seed: int = 0, exclude: Collection[str] = ()) -> list[str]:
    """The first ``n`` standard-library snippets not in ``exclude``, shuffled with ``seed``.

    Raises if fewer than ``n`` are left."""
    excluded = set(exclude)
    snippets = [s for s in _stdlib_snippets() if s not in excluded]
    random.Random(seed).shuffle(snippets)
    if len(snippets) < n:
        raise ValueError(
            f"the standard library has {len(snippets)} prompts left ({len(excluded)} excluded), "
            f"{n} asked: lower --num-prompts"
        )
    return snippets[:n]


def snippets_used_by(recipes: list[dict]) -> set[str]:
    """The standard-library snippets that training stages (their recipes as stored in
    ``report.json``, oldest first) prompted with, so a new stage can train on fresh ones."""
    used: set[str] = set()
    for r in recipes:
        if r.get("prompts_file"):  # a user's prompts: none from the corpus
            continue
        exclude = used if r.get("fresh_prompts") else ()
        used |= set(stdlib_snippets(r["num_prompts"], r["train"]["seed"], exclude))
    return used


def build_prompts(
    tokenizer, n: int, seed: int = 0, chat_share: float = 0.5, exclude: Collection[str] = ()
) -> list[list[int]]:
    """``n`` distinct prompts from the standard library, shuffled with ``seed``: raw
    completions, and with ``chat_share`` > 0 every other one as a chat request instead."""
    prompts = []
    for i, snippet in enumerate(stdlib_snippets(n, seed, exclude)):
        if tokenizer.chat_template is not None and i % 2 == 0 and chat_share > 0:
            content = CHAT_REQUEST.format(snippet)
            prompts.append(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}], add_generation_prompt=True
                )
            )
        else:
            prompts.append(tokenizer.encode(snippet + "\n"))
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


def greedy_with_hidden(
    model: nn.Module,
    prompts: list[list[int]],
    max_tokens: int,
    stop_tokens: set[int],
    sampling: SamplingParams | None = None,
) -> list[tuple[list[int], np.ndarray]]:
    """Batched answers (greedy, or sampled as mlx-lm samples) and, for each answer token,
    the hidden state that produced it.

    Prompts are left-padded into mlx-lm's BatchKVCache; finished rows leave the batch.
    Returns (answer, hidden [len(answer), H] float16) per prompt, stop token excluded.
    """
    sampling = sampling or SamplingParams()
    from mlx_lm.models.cache import BatchKVCache

    adapter = adapter_for(model)
    L = max(len(p) for p in prompts)
    pads = [L - len(p) for p in prompts]
    ids = mx.array([[0] * pad + p for p, pad in zip(prompts, pads, strict=True)], mx.int32)
    cache = [BatchKVCache(left_padding=pads) for _ in model.layers]
    h = adapter.hidden_states(model, ids, cache)[:, -1]  # [B, H]
    answers: list[list[int]] = [[] for _ in prompts]
    hiddens: list[list[np.ndarray]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))
    for _ in range(max_tokens):
        tok = node_targets(adapter.lm_head(model, h), sampling)
        h16 = h.astype(mx.float16)
        mx.eval(tok, h16)
        tokens, states = tok.tolist(), np.array(h16)
        keep = []
        for row, b in enumerate(alive):
            if tokens[row] in stop_tokens:
                continue
            answers[b].append(tokens[row])
            hiddens[b].append(states[row])
            if len(answers[b]) < max_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(alive):
            index = mx.array(keep)
            for c in cache:
                c.filter(index)
            tok = tok[index]
            alive = [alive[r] for r in keep]
        h = adapter.hidden_states(model, tok[:, None], cache)[:, -1]
    H = h.shape[-1]
    return [
        (a, np.stack(hs) if hs else np.zeros((0, H), np.float16))
        for a, hs in zip(answers, hiddens, strict=True)
    ]


def generate_dataset(
    model: nn.Module,
    prompts: list[list[int]],
    folder: Path,
    stop_tokens: set[int],
    max_tokens: int = 160,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
    answer_new: bool = True,
) -> tuple[list[Sample], dict[int, np.ndarray]]:
    """Answer every prompt (greedy) and keep the answers' hidden states, batch by batch.

    Batches take prompts of similar length (less padding), near the corpus order. Each finished
    batch is written as one new ``hidden-NNNNN.safetensors`` shard (keys: prompt indices) and
    then its lines in ``generations.jsonl`` (each naming its shard), so an interrupted run
    resumes with the prompts still unanswered, whatever ``batch_size`` the new run uses:
    existing shards are never overwritten, and the first answer of a prompt is the one kept.
    With ``answer_new=False`` nothing is generated: the prompts not yet answered come back
    with empty answers (and no hidden states), so training can use the folder as it is.
    Returns samples and hidden states by index.
    """
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / "generations.jsonl"
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    done: dict[int, dict] = {}
    for r in rows:
        done.setdefault(r["index"], r)
    for r in done.values():
        if r["index"] >= len(prompts) or r["prompt"] != prompts[r["index"]]:
            raise ValueError(f"{jsonl}: cached answers belong to other prompts; use a new folder")
    shards = sorted(folder.glob("hidden-*.safetensors"))
    next_shard = max((int(p.stem.split("-")[1]) for p in shards), default=-1) + 1
    # Prompts are answered in corpus order, sorted by length only within groups of
    # GROUP_BATCHES batches: little padding, and a run stopped early has answered a fair
    # sample of the corpus (sorting all of it first answered only the short prompts).
    pending = [i for i in range(len(prompts)) if i not in done] if answer_new else []
    group = batch_size * GROUP_BATCHES
    todo = []
    for g in range(0, len(pending), group):
        todo += sorted(pending[g : g + group], key=lambda i: len(prompts[i]))
    batches = [todo[s : s + batch_size] for s in range(0, len(todo), batch_size)]
    with jsonl.open("a") as f:
        for n, batch in enumerate(batches):
            shard = folder / f"hidden-{next_shard + n:05d}.safetensors"
            results = greedy_with_hidden(
                model, [prompts[i] for i in batch], max_tokens, stop_tokens
            )
            arrays = {
                str(i): mx.array(h) for i, (_, h) in zip(batch, results, strict=True) if len(h)
            }
            tmp = shard.with_name(f".{shard.stem}.tmp.safetensors")  # mlx keeps the suffix
            mx.save_safetensors(str(tmp), arrays)
            tmp.rename(shard)
            for i, (answer, _) in zip(batch, results, strict=True):
                done[i] = {"index": i, "prompt": prompts[i], "answer": answer, "shard": shard.name}
                f.write(json.dumps(done[i]) + "\n")
            f.flush()
            if progress:
                progress(len(prompts) - len(todo) + sum(map(len, batches[: n + 1])), len(prompts))
    hidden: dict[int, np.ndarray] = {}
    for path in sorted(folder.glob("hidden-*.safetensors")):
        for key, value in mx.load(str(path)).items():
            i = int(key)
            if i not in done:  # a shard whose answer line was lost: answered again or unused
                continue
            # A row names its shard; rows written before shards were named take the first.
            wanted = done[i].get("shard", path.name if i not in hidden else None)
            if wanted == path.name:
                hidden[i] = np.array(value)
    samples = [Sample(p, done[i]["answer"] if i in done else []) for i, p in enumerate(prompts)]
    return samples, hidden
