"""The generation loop: draft, pack, verify, accept, commit; and the autoregressive baseline.

One ReDrafter step, with the device arrays kept lazy throughout::

    beams  = propose(h, g0)                     # drafter beam search   [W, L]
    beams[-1] = lookup(context)                 # host: copied, where the context repeats
    tree   = pack_beams(beams)                  # host, NumPy            n tokens
    hidden = llm(tree, mask, positions)         # one LLM forward       [n, H]
    acc    = accept(beams, targets(hidden))     # longest accepted path
    h, g0  = hidden[acc.last], target[acc.last] # state for the next step
    beams' = propose(h, g0)                     # next draft, still lazy
    sync: acc.tokens, acc.count, beams'         # the step's only host synchronisation

The next draft is built before the sync, so each step costs one round trip to the device
(two with the LM head's int8 screen, :mod:`.greedy_head` for greedy and :mod:`.nucleus_screen`
for top-p sampling, which read the hidden states on the host: on the CPU a round trip costs next
to nothing, and the screen saves most of the head).
With one beam and prompt lookup (no budget), a lookup match replaces that beam, so the next
draft waits for the step's tokens and runs only where the lookup misses (one more round trip
on those steps; on HumanEval the drafter is skipped on ~30% of the steps);
``profile=True`` adds a sync after each phase to time them (and so runs slower): ``tree``
(beams to the host, prompt lookup, packing, pruning), ``verify`` (the LLM forward and its targets),
``accept``, ``draft`` (the next beam search) and ``commit`` (reading the result on the host,
keeping the accepted path in the KV cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.sample_utils import make_sampler

from .beam_search import Proposer, make_proposer
from .drafter import Drafter
from .greedy_head import GreedyHead
from .kv_cache import TreeKVCache
from .llm import TreeLLM
from .loading import check_compatible, compute_dtype
from .nucleus_screen import ScreenedNucleus, screen_pays
from .prompt_lookup import DEFAULT_MIN_NGRAM, LONGEST_NGRAM, PromptLookup
from .tree_attention import pack_beams
from .tree_budget import TreeBudget, measure_step_cost
from .verification import (
    Acceptance,
    SamplingParams,
    accept,
    greedy_targets,
    node_targets,
    walk_targets,
)


@dataclass
class StepStats:
    """One verification step (the first token, from the prompt, is step 0 with no tree)."""

    emitted: int  # tokens this step yielded (after stop-token and max_tokens cuts)
    accepted: int  # drafted tokens the LLM accepted (emitted = accepted + 1 when uncut)
    tree_size: int  # packed tokens verified
    time: float  # seconds, wall clock
    phases: dict[str, float] | None = None  # seconds per phase, measured only with profile=True
    looked_up: bool = False  # a prompt-lookup draft took the place of a drafter beam


@dataclass
class GenerationSummary:
    prompt_tokens: int = 0
    prompt_time: float = 0.0  # seconds to the first generated token
    generation_tokens: int = 0
    generation_time: float = 0.0  # seconds from the first generated token to the last
    steps: int = 0  # verification steps (AR: one per token after the first)
    peak_memory_gb: float = 0.0  # see stream_autoregressive / _redrafter_steps for what counts
    finish_reason: str | None = None  # "stop" or "length" once finished
    accepted_by_depth: list[int] = field(default_factory=list)  # steps accepting >= d drafts
    lookup_steps: int = 0  # steps that verified a prompt-lookup draft

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        """Tokens after the first, per second after the first (mlx-lm counts all N over that)."""
        n = self.generation_tokens - 1
        return n / self.generation_time if self.generation_time > 0 and n > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens per LLM forward after the prompt (1.0 for autoregressive decoding)."""
        return (self.generation_tokens - 1) / self.steps if self.steps else 0.0


@dataclass
class StepOutput:
    tokens: list[int]
    stats: StepStats
    summary: GenerationSummary  # running totals, final once finish_reason is set


def _as_prompt(prompt: Sequence[int] | mx.array) -> list[int]:
    ids = prompt.tolist() if isinstance(prompt, mx.array) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    return ids


class _Emitter:
    """Applies stop tokens and max_tokens to the stream of accepted tokens."""

    def __init__(self, summary: GenerationSummary, max_tokens: int, stop_tokens: Iterable[int]):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.summary, self.max_tokens = summary, max_tokens
        self.stop = frozenset(int(t) for t in stop_tokens)

    def cut(self, tokens: list[int]) -> list[int]:
        out = []
        for t in tokens:
            if t in self.stop:
                self.summary.finish_reason = "stop"
                break
            out.append(t)
            if self.summary.generation_tokens + len(out) >= self.max_tokens:
                self.summary.finish_reason = "length"
                break
        self.summary.generation_tokens += len(out)
        return out


def prefill(
    llm: TreeLLM, cache: list[TreeKVCache], prompt: list[int], step_size: int = 2048
) -> mx.array:
    """Feed the prompt in chunks; return the last position's hidden state [H]."""
    start = cache[0].length
    for s in range(0, len(prompt), step_size):
        chunk = mx.array(prompt[s : s + step_size], dtype=mx.int32)
        hidden = llm.hidden_states(chunk, cache, positions=start + s)
        if s + step_size < len(prompt):
            mx.eval([c.state for c in cache])
    return hidden[-1]


def on_stream(steps: Iterator[StepOutput], stream) -> Iterator[StepOutput]:
    """Advance ``steps`` with ``stream`` as the default stream, the caller's code between
    yields keeping its own (a ``with mx.stream`` around a ``yield`` would leak into it)."""
    while True:
        with mx.stream(stream):
            out = next(steps, None)
        if out is None:
            return
        yield out


def stream_redrafter(
    llm: TreeLLM,
    propose: Proposer,
    prompt: Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop_tokens: Iterable[int] = (),
    cache: list[TreeKVCache] | None = None,
    profile: bool = False,
    prefill_step_size: int = 2048,
    budget: TreeBudget | None = None,
    lookup: int = 0,
    history: Sequence[int] = (),
    head_screen: bool = True,
) -> Iterator[StepOutput]:
    """Generate with ReDrafter, yielding the tokens of each step as soon as they are accepted.

    Greedy output equals autoregressive greedy decoding; with ``sampling.temp > 0`` the output
    follows the LLM's (processed) distribution exactly (see :mod:`redrafter_mlx.verification`).
    Stop tokens end generation and are not yielded; ``max_tokens`` counts yielded tokens.
    After each step the cache holds exactly the prompt and the tokens yielded so far except
    the newest (which is fed to the LLM as the next tree's root).

    It runs on mlx-lm's ``generation_stream``, the stream ``generate_step`` uses: on the CPU
    each stream has its own worker thread, and an OpenMP BLAS (MKL) keeps a thread team per
    calling thread, so running the two decoders on two streams in one process slowed mlx-lm's
    AR after a ReDrafter run (measured with MKL: 11.4 -> 9.4 tokens/s; in a bench grid ~2x).

    ``budget`` (a :class:`~redrafter_mlx.tree_budget.TreeBudget` built from the step cost that
    :func:`~redrafter_mlx.tree_budget.measure_step_cost` measures) prunes each tree to the
    nodes worth their verification cost; it needs a proposer that scores its beams
    (``make_proposer(..., with_scores=True)``). Without it every drafted node is verified.

    ``lookup`` (the shortest n-gram to match; 0: off) verifies, whenever the context's last
    ``lookup`` or more tokens occurred earlier in it, the tokens that followed them in place of
    the drafter's lowest-ranked beam (:mod:`redrafter_mlx.prompt_lookup`; the longest match of
    up to ``max(LONGEST_NGRAM, lookup)`` tokens wins). With a budget those nodes are
    always verified (their prefix score is taken as 0, which also leaves the calibration
    unchanged). ``history`` is the text before ``prompt`` that ``cache`` already holds (a chat's
    earlier turns): lookup searches it too.

    ``head_screen`` takes the targets from an int8 screen of the LM head and an exact recount
    of the few columns that matter, where the few-row kernel computes the head: for greedy the
    columns that could win (:mod:`redrafter_mlx.greedy_head`), for temperature with top-p the
    tokens that could be in the nucleus (:mod:`redrafter_mlx.nucleus_screen`). The same tokens
    (greedy) or the same draws (sampling), without streaming the float32 head.
    """
    if lookup < 0:
        raise ValueError(f"lookup is the shortest n-gram to match (0: off), got {lookup}")
    steps = _redrafter_steps(
        llm,
        propose,
        prompt,
        max_tokens,
        sampling,
        stop_tokens,
        cache,
        profile,
        prefill_step_size,
        budget,
        lookup,
        [int(t) for t in history],
        head_screen,
    )
    return on_stream(steps, generation_stream)


def _redrafter_steps(
    llm: TreeLLM,
    propose: Proposer,
    prompt: Sequence[int] | mx.array,
    max_tokens: int,
    sampling: SamplingParams | None,
    stop_tokens: Iterable[int],
    cache: list[TreeKVCache] | None,
    profile: bool,
    prefill_step_size: int,
    budget: TreeBudget | None,
    lookup: int,
    history: list[int],
    head_screen: bool,
) -> Iterator[StepOutput]:
    sampling = sampling or SamplingParams()
    prompt_ids = _as_prompt(prompt)
    summary = GenerationSummary(prompt_tokens=len(prompt_ids))
    emitter = _Emitter(summary, max_tokens, stop_tokens)
    cache = cache if cache is not None else llm.make_cache()
    # Greedy targets and top-p draws from the LM head's int8 screen where they are provably
    # exact (built once per model, before the clock starts).
    screenable = sampling.greedy or ScreenedNucleus.takes(sampling)
    head = GreedyHead.for_model(llm.model) if screenable and head_screen else None
    # The peak is the process's (the LLM's and the drafter's weights, caches, temporaries) plus
    # NumPy memory that MLX does not count (the screen, an int8 drafter's copies).
    extra_bytes = (head.nbytes if head is not None else 0) + getattr(propose, "nbytes", 0)
    mx.reset_peak_memory()

    tic = time.perf_counter()
    hidden = prefill(llm, cache, prompt_ids, prefill_step_size)
    g0 = node_targets(llm.logits(hidden[None]), sampling)[0]
    beams, scores = _draft(propose, hidden, g0, budget is not None)
    mx.eval(g0, beams, scores)
    summary.prompt_time = time.perf_counter() - tic
    first = emitter.cut([int(g0.item())])
    summary.peak_memory_gb = (mx.get_peak_memory() + extra_bytes) / 1e9
    yield StepOutput(first, StepStats(len(first), 0, 0, summary.prompt_time), summary)
    if summary.finish_reason:
        return
    context = None
    # Solo mode (one beam, no budget): a lookup match replaces the drafter's only beam, so the
    # drafter runs only once the step's tokens show that the lookup has missed.
    solo = bool(lookup) and beams.shape[0] == 1 and budget is None
    if lookup:
        longest = max(LONGEST_NGRAM, lookup)
        context = PromptLookup(history + prompt_ids + first, beams.shape[1] - 1, longest, lookup)
    root = first[-1]  # the next tree's root token (solo mode)
    pending: tuple[mx.array, mx.array] | None = None  # (hidden, g0) of the draft not yet run

    # NumPy draws (walk_targets) from a generator seeded by MLX's: mx.random.seed reproduces runs.
    rng = None
    if sampling.host_drawable:
        rng = np.random.default_rng(int(mx.random.randint(0, 2**31)))
    past = cache[0].length  # absolute position of the root g0
    screened_steps = (0, 0)  # top-p steps drawn through the screen, and those it fell back on
    gen_start = time.perf_counter()
    while True:
        clock = _PhaseClock(profile)
        copied = context.propose() if context is not None else None
        if solo and copied is not None:  # the copy alone: the drafter is not run
            drafted = np.array([[root, *copied]], dtype=np.int32)
            beams = mx.array(drafted)
        else:
            if pending is not None:  # solo mode drafts only once the lookup has missed
                beams, scores = _draft(propose, *pending, False)
                clock.lap("draft", beams)
            drafted = np.array(beams)
            if copied is not None:  # in place of the lowest-ranked beam
                drafted[-1, 1:] = copied
                if scores is not None:
                    scores = np.array(scores)
                    scores[-1] = 0.0
                beams = mx.array(drafted)
        pending = None
        tree = pack_beams(drafted)
        if budget is not None:  # verify only the nodes worth it; the rest become NO_TOKEN
            tree, drafted = budget.prune(tree, drafted, np.array(scores))
            beams = mx.array(drafted)
        clock.lap("tree")
        hidden = llm.hidden_states(
            mx.array(tree.tokens),
            cache,
            positions=mx.array(tree.positions(past)),
            ancestors=mx.array(tree.ancestor_mask()),
        )
        logits = llm.logits(hidden)  # lazy: the screen below usually leaves it unevaluated
        unsure = None
        usable = head is not None and head.usable(tree.size)
        screened = head.targets(hidden) if usable and sampling.greedy else None
        if screened is not None:  # the int8 screen and an exact recount (one more sync)
            targets, unsure = mx.array(screened[0]), mx.array(screened[1])
        elif sampling.greedy and logits.dtype == mx.float32:  # no sync before acceptance
            targets, unsure = greedy_targets(logits)
        elif sampling.greedy:
            targets = node_targets(logits, sampling)
        else:  # process and sample only the rows the walk visits (see walk_targets)
            nucleus = None
            if usable and screen_pays(*screened_steps):
                nucleus = ScreenedNucleus(head, hidden, sampling)
            screen = nucleus.draw if nucleus is not None else None
            targets = walk_targets(logits, tree.children(), sampling, rng, screen)
            if nucleus is not None:
                screened_steps = (screened_steps[0] + 1, screened_steps[1] + (nucleus.declined > 0))
        clock.lap("verify", targets)
        # Solo mode decides whether to draft after the lookup has seen this step's tokens.
        args = (None if solo else propose, beams, mx.array(tree.unpacker), hidden)
        args += (budget is not None, clock)
        acc, beams, scores = _accept_and_draft(*args, targets, also=unsure)
        if unsure is not None and unsure.item():  # a near-tie (rare): mlx-lm's exact argmax
            targets = node_targets(logits, sampling)
            acc, beams, scores = _accept_and_draft(*args, targets)
        if solo:
            pending = (hidden[acc.last], targets[acc.last])

        count, beam = int(acc.count.item()), int(acc.beam.item())
        if budget is not None:
            budget.observe(acc.path.tolist()[:count])
        accepted = acc.tokens.tolist()[:count]
        if context is not None:
            context.extend(accepted)
        root = accepted[-1]
        tokens = emitter.cut(accepted)
        # Keep the root and the emitted tokens but the newest (fewer than count if cut short).
        for c in cache:
            c.commit(None if beam == 0 else acc.path, tree.size, len(tokens))
        past += len(tokens)
        clock.lap("commit", *(x for c in cache for x in (c.keys, c.values)))

        summary.steps += 1
        summary.lookup_steps += copied is not None
        summary.generation_time = time.perf_counter() - gen_start
        summary.peak_memory_gb = (mx.get_peak_memory() + extra_bytes) / 1e9
        depth_hist = summary.accepted_by_depth
        depth_hist.extend([0] * (count - 1 - len(depth_hist)))
        for d in range(count - 1):
            depth_hist[d] += 1
        stats = StepStats(
            emitted=len(tokens),
            accepted=count - 1,
            tree_size=tree.size,
            time=clock.total(),
            phases=clock.phases if profile else None,
            looked_up=copied is not None,
        )
        yield StepOutput(tokens, stats, summary)
        if summary.finish_reason:
            return


class _PhaseClock:
    """Wall time of a step and, when profiling, of each phase (a sync ends each phase)."""

    def __init__(self, profile: bool):
        self.profile = profile
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str, *arrays: mx.array) -> None:
        if not self.profile:
            return
        mx.eval(*arrays)
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.start


def _accept_and_draft(
    propose: Proposer | None,
    beams: mx.array,
    unpacker: mx.array,
    hidden: mx.array,
    need_scores: bool,
    clock: _PhaseClock,
    targets: mx.array,
    also: mx.array | None = None,
) -> tuple[Acceptance, mx.array | None, mx.array | None]:
    """The step's outcome and the next draft from its last accepted node, evaluated together
    (with ``also``) in the step's one host synchronisation. Without a proposer (solo mode),
    the outcome alone (next beams and scores None)."""
    acc = accept(beams, unpacker, targets)
    clock.lap("accept", acc.tokens, acc.count, acc.beam)
    next_beams = scores = None
    if propose is not None:
        next_beams, scores = _draft(propose, hidden[acc.last], targets[acc.last], need_scores)
        clock.lap("draft", next_beams, scores)
    mx.eval(acc.tokens, acc.count, acc.beam, acc.path, next_beams, scores, also)
    return acc, next_beams, scores


def _draft(
    propose: Proposer, hidden: mx.array, g0: mx.array, need_scores: bool
) -> tuple[mx.array, mx.array | None]:
    """Beams [W, L] and, if the proposer gives them, their prefix scores [W, L]."""
    out = propose(hidden, g0)
    beams, scores = out if isinstance(out, tuple) else (out, None)
    if need_scores and scores is None:
        raise ValueError(
            "tree pruning (a budget) needs a proposer that scores its beams: "
            "make_proposer(..., with_scores=True)"
        )
    return beams, scores


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters, evaluated first so that they are resident (counted once,
    before a peak is measured, rather than inside it)."""
    params = [v for _, v in tree_flatten(module.parameters())]
    mx.eval(params)
    return sum(v.nbytes for v in params)


def stream_autoregressive(
    model: nn.Module,
    prompt: Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop_tokens: Iterable[int] = (),
) -> Iterator[StepOutput]:
    """The baseline: mlx-lm's own ``generate_step``, with the same stop/length rules."""
    sampling = sampling or SamplingParams()
    prompt_ids = _as_prompt(prompt)
    summary = GenerationSummary(prompt_tokens=len(prompt_ids))
    emitter = _Emitter(summary, max_tokens, stop_tokens)
    sampler = make_sampler(
        temp=sampling.temp,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        min_tokens_to_keep=sampling.min_tokens_to_keep,
        top_k=sampling.top_k,
    )
    # The decoding's own peak: the LLM's weights plus what generate_step allocates above what
    # was resident when it started. Arrays it never touches (in a bench, the drafter's weights)
    # are left out, as they would be in a process that only runs mlx-lm.
    weights = parameter_bytes(model)
    resident = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = last = time.perf_counter()
    gen_start = None
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=sampler)
    for token, _ in steps:
        now = time.perf_counter()
        tokens = emitter.cut([int(token)])
        if gen_start is None:
            summary.prompt_time, gen_start = now - tic, now
        else:
            summary.steps += 1
            summary.generation_time = now - gen_start
        summary.peak_memory_gb = (mx.get_peak_memory() - resident + weights) / 1e9
        yield StepOutput(tokens, StepStats(len(tokens), 0, 1, now - last), summary)
        last = now
        if summary.finish_reason:
            return


def step_cost(model: nn.Module, drafter: Drafter, beam_width: int, beam_length: int) -> list[float]:
    """Seconds of a step verifying 1 .. 1 + W (L - 1) tokens, measured here, on the stream
    generation runs on: the ``step_cost`` of a :class:`~redrafter_mlx.tree_budget.TreeBudget`."""
    check_compatible(drafter, model)
    llm = TreeLLM(model)
    # Scored beams are a float search: cast as stream_generate's pruned runs are.
    propose = make_proposer(
        drafter, llm.embed, beam_width, beam_length, with_scores=True, dtype=compute_dtype(model)
    )
    head = GreedyHead.for_model(model)
    with mx.stream(generation_stream):
        return measure_step_cost(llm, propose, 1 + beam_width * (beam_length - 1), head=head)


def stream_generate(
    model: nn.Module,
    drafter: Drafter,
    prompt: Sequence[int] | mx.array,
    *,
    beam_width: int = 4,
    beam_length: int = 5,
    draft_top_k: int | None = None,
    budget: TreeBudget | None = None,
    lookup: int = DEFAULT_MIN_NGRAM,
    **kwargs,
) -> Iterator[StepOutput]:
    """ReDrafter generation from an mlx-lm model and a drafter (see :func:`stream_redrafter`),
    with prompt lookup on by default (``lookup=0`` turns it off).

    A ``budget`` may be shared by many calls (a chat session): its calibration carries over.
    The drafter is cast to the LLM's dtype in place where it drafts in floating point; the
    int8 one-beam drafts (W=1 without a budget, where the few-row kernel runs) read a shipped
    drafter's float16 as it is, so it stays float16 (see ``dtype`` in :func:`make_proposer`).
    """
    check_compatible(drafter, model)
    llm = TreeLLM(model)
    propose = make_proposer(
        drafter,
        llm.embed,
        beam_width,
        beam_length,
        top_k=draft_top_k,
        with_scores=budget is not None,
        int8=True,
        dtype=compute_dtype(model),
    )
    return stream_redrafter(llm, propose, prompt, budget=budget, lookup=lookup, **kwargs)
