"""Would drafts from an n-gram datastore of the standard library's code add tokens/step?

Retrieval drafting (REST, He et al. 2023) proposes the continuation that most often followed
the context's last n tokens in a corpus. Here the corpus is the Python standard library's own
source (~2.9M tokens with the demo model's tokenizer; HumanEval is not in it), indexed for
n-grams of 1-8 tokens by their most frequent ``L - 1``-token continuation. On HumanEval's
greedy continuations (cached by ``bench/drafter_card.py``; exact for greedy, see
redrafter_mlx/acceptance.py) it replays the engine's one-beam policy (prompt lookup where the
context matches, else the drafter) against the same with the datastore's draft in the
drafter's place wherever its longest match has at least ``n`` tokens, its continuation at least
``share`` of that n-gram's occurrences and ``count`` of them; and, as a bound no one-beam policy
can pass, the best of all three drafts at every step. Prints tokens/step; writes JSON.

    python bench/datastore_replay.py --problems 0-99
"""

from __future__ import annotations

import argparse
import itertools
import sysconfig
import types
from pathlib import Path

import redrafter_mlx  # noqa: F401  (first: loads MKL or OpenBLAS on Linux)
from redrafter_mlx.beam_search import beam_search
from redrafter_mlx.benchmark import humaneval_prompts, machine_info, write_json
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load
from redrafter_mlx.prompt_lookup import DEFAULT_MIN_NGRAM, LONGEST_NGRAM, PromptLookup
from redrafter_mlx.verification import SamplingParams

import mlx.core as mx
import numpy as np
from drafter_card import answers, cache_file
from lookup_replay import matched
from paired import shipped

BITS = 18  # token ids below 2^18 (Qwen2.5: 151936): a continuation packs exactly into an int64
HASH = np.uint64(0x9E3779B97F4A7C15)


def stdlib_tokens(tokenizer) -> np.ndarray:
    """Every standard-library source file (tests and IDLE aside) as tokens, -1 between files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages"}
    parts = []
    for path in sorted(p for p in root.rglob("*.py") if not skip & set(p.parts)):
        try:
            parts += [tokenizer.encode(path.read_text(encoding="utf-8")), [-1]]
        except UnicodeDecodeError:
            continue
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len - n + 1] hashes of tokens[i : i + n] (wrapping uint64 arithmetic)."""
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    for k in range(n):
        h = h * HASH + (tokens[k : len(tokens) - n + 1 + k].astype(np.uint64) + np.uint64(1))
    return h


class Datastore:
    """For each n-gram size: sorted n-gram hashes, each with its most frequent continuation of
    ``m`` tokens, that continuation's count and the n-gram's count."""

    def __init__(self, tokens: np.ndarray, sizes: range, m: int):
        if tokens.max() >= 1 << BITS:
            raise ValueError(f"token ids must be below 2^{BITS} to pack, got {tokens.max()}")
        self.m, self.sizes, self.tables = m, sorted(sizes, reverse=True), {}
        breaks = np.concatenate([[0], np.cumsum(tokens < 0)])
        for n in self.sizes:
            starts = np.arange(len(tokens) - n - m + 1)
            whole = breaks[starts + n + m] == breaks[starts]  # n-gram and continuation in a file
            keys = ngram_hashes(tokens, n)[: len(starts)][whole]
            cont = np.zeros(len(starts), dtype=np.int64)
            for k in range(m):
                cont = (cont << BITS) | np.maximum(tokens[n + k : n + k + len(starts)], 0)
            cont = cont[whole]
            order = np.lexsort((cont, keys))
            keys, cont = keys[order], cont[order]
            first = np.r_[True, (keys[1:] != keys[:-1]) | (cont[1:] != cont[:-1])]
            at = np.flatnonzero(first)
            pair_keys, pair_conts = keys[at], cont[at]
            counts = np.diff(np.r_[at, len(keys)])
            key_starts = np.flatnonzero(np.r_[True, pair_keys[1:] != pair_keys[:-1]])
            totals = np.add.reduceat(counts, key_starts)
            order = np.lexsort((-counts, pair_keys))  # most frequent continuation first
            pair_keys, pair_conts, counts = pair_keys[order], pair_conts[order], counts[order]
            best = np.r_[True, pair_keys[1:] != pair_keys[:-1]]
            self.tables[n] = (pair_keys[best], pair_conts[best], counts[best], totals)

    def propose(self, context: list[int]) -> tuple[list[int], int, int, int] | None:
        """(continuation, n, its count, the n-gram's count) for the longest n-gram that ends
        ``context`` and occurs in the corpus; None if none does."""
        for n in self.sizes:
            if len(context) < n:
                continue
            h = ngram_hashes(np.array(context[-n:], dtype=np.int64), n)[0]
            keys, conts, counts, totals = self.tables[n]
            j = int(np.searchsorted(keys, h))
            if j < len(keys) and keys[j] == h:
                c = int(conts[j])
                mask = (1 << BITS) - 1
                toks = [(c >> (BITS * (self.m - 1 - k))) & mask for k in range(self.m)]
                return toks, n, int(counts[j]), int(totals[j])
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--problems", default="0-99")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--length", type=int, default=3)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--min-ngram", default="3,4,5,6", help="shortest datastore matches, each")
    ap.add_argument("--share", default="0.5,0.8", help="least share of the continuation, each")
    ap.add_argument("--count", default="2,5", help="least count of the continuation, each")
    ap.add_argument("--out", default="bench/results/datastore_replay.json")
    args = ap.parse_args()
    model_dir, entry = shipped(ap, args.model)
    model, tokenizer, drafter = load(model_dir, entry.drafter_dir)
    embed = TreeLLM(model).embed
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.problems)]
    key = types.SimpleNamespace(**vars(args), no_cache=False)
    stop = set(tokenizer.eos_token_ids)
    conts, hidden = answers(
        model, prompts, args.max_tokens, stop, SamplingParams(), args.batch,
        cache_file(model_dir, key, "greedy"),
    )  # fmt: skip
    corpus = stdlib_tokens(tokenizer)
    store = Datastore(corpus, range(1, 9), args.length - 1)
    print(f"datastore: {len(corpus)} standard-library tokens", flush=True)

    drafts: dict[tuple[int, int], list[int]] = {}  # (problem, root position): shared by runs

    def drafted(i: int, p: int) -> list[int]:
        if (i, p) not in drafts:
            state = mx.array(hidden[i][p][None].astype(np.float32))
            beams = beam_search(drafter, embed, state, mx.array([conts[i][p]]), 1, args.length)
            drafts[(i, p)] = np.array(beams.tokens)[0, 0, 1:].tolist()
        return drafts[(i, p)]

    def replay(choose) -> tuple[float, dict[str, int]]:
        steps = tokens = 0
        sources = {"lookup": 0, "datastore": 0, "drafter": 0, "best of all": 0}
        for i, (prompt, c) in enumerate(zip(prompts, conts, strict=True)):
            context = PromptLookup(
                prompt + c[:1], args.length - 1, LONGEST_NGRAM, DEFAULT_MIN_NGRAM
            )
            p = 0
            while p < len(c) - 1:
                source, proposals = choose(context, drafted(i, p))
                sources[source] += 1
                future = c[p + 1 : p + args.length]
                a = min(max(matched(d, future) for d in proposals), len(c) - 2 - p)
                steps, tokens = steps + 1, tokens + a + 1
                context.extend(c[p + 1 : p + a + 2])
                p += a + 1
        return tokens / steps, sources

    def engine(context, draft):
        found = context.propose()
        return ("lookup", [found]) if found else ("drafter", [draft])

    def retrieval(min_n: int, share: float, count: int):
        def choose(context, draft):
            found = context.propose()
            if found:
                return "lookup", [found]
            hit = store.propose(context.tokens)
            if hit is not None and hit[1] >= min_n and hit[2] >= max(count, share * hit[3]):
                return "datastore", [hit[0]]
            return "drafter", [draft]

        return choose

    def best_of_all(context, draft):
        found, hit = context.propose(), store.propose(context.tokens)
        return "best of all", [draft] + ([found] if found else []) + ([hit[0]] if hit else [])

    rows = []
    runs = [("engine (lookup, else drafter)", {}, engine)]
    for n, s, k in itertools.product(
        *(
            map(t, getattr(args, a).split(","))
            for t, a in [(int, "min_ngram"), (float, "share"), (int, "count")]
        )
    ):
        runs.append(
            (
                f"datastore n>={n} share>={s} count>={k}",
                dict(min_ngram=n, share=s, count=k),
                retrieval(n, s, k),
            )
        )
    runs.append(("best of all three (a bound)", {}, best_of_all))
    for name, params, choose in runs:
        tps, sources = replay(choose)
        rows.append({"policy": name, **params, "tokens_per_step": tps, "steps_by_source": sources})
        used = ", ".join(f"{k} {v}" for k, v in sources.items() if v)
        print(f"{name:40s} {tps:.3f} tokens/step ({used})", flush=True)
    write_json(args.out, {"args": vars(args), "machine": machine_info(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
