"""Greedy ReDrafter output equals mlx-lm's greedy decoding, token for token."""

import functools

import redrafter_mlx.generate
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.generate import stream_autoregressive, stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.oracle import OracleProposer
from redrafter_mlx.verification import NEAR_TIE, SamplingParams, greedy_targets, node_targets

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_drafter, tiny_llm

VOCAB = 64
FAMILIES = ("llama", "qwen2", "gemma3_text", "llama_swa")
N_CASES = 216


@functools.cache
def model_for(family: str, seed: int):
    model = tiny_llm(family, vocab_size=VOCAB, seed=seed, window=6)
    return model, TreeLLM(model)


@functools.cache
def reference(family: str, seed: int, prompt: tuple, max_tokens: int) -> list[int]:
    model, _ = model_for(family, seed)
    return [
        t
        for out in stream_autoregressive(model, list(prompt), max_tokens=max_tokens)
        for t in out.tokens
    ]


def make_case(i: int) -> dict:
    rng = np.random.default_rng(1234 + i)
    return dict(
        family=FAMILIES[i % len(FAMILIES)],
        seed=int(rng.integers(0, 2)),
        W=int(rng.integers(1, 9)),
        L=int(rng.integers(2, 7)),
        prompt=tuple(int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(1, 20)))),
        max_tokens=int(rng.integers(8, 41)),
        drafter="oracle" if rng.random() < 0.4 else "random",
        draft_top_k=[None, 5][int(rng.integers(0, 2))],
        draft_vocab=bool(rng.random() < 0.3),
        slack=int(rng.integers(0, 4)),  # tiny window slack: the window caches drop often
        lookup=int(rng.integers(0, 4)),  # prompt-lookup n-gram size (0: off)
    )


def run(case: dict) -> tuple[list[int], list[int], list]:
    model, llm = model_for(case["family"], case["seed"])
    ref = reference(case["family"], case["seed"], case["prompt"], case["max_tokens"])
    W, L = case["W"], case["L"]
    if case["drafter"] == "oracle":
        propose = OracleProposer(llm, case["prompt"], ref, W, L, VOCAB)
    else:
        vocab = sorted(set(range(0, VOCAB, 3))) if case["draft_vocab"] else None
        drafter = tiny_drafter(32, VOCAB, seed=hash(case["prompt"]) % 100, draft_vocab=vocab)
        propose = make_proposer(drafter, llm.embed, W, L, top_k=case["draft_top_k"])
    outs = list(
        stream_redrafter(
            llm,
            propose,
            list(case["prompt"]),
            max_tokens=case["max_tokens"],
            cache=llm.make_cache(window_slack=case["slack"]),
            lookup=case["lookup"],
        )
    )
    got = [t for out in outs for t in out.tokens]
    return got, ref, outs


@pytest.mark.parametrize("i", range(N_CASES))
def test_greedy_equals_mlx_lm(i):
    case = make_case(i)
    got, ref, outs = run(case)
    assert got == ref, case
    summary = outs[-1].summary
    assert summary.finish_reason == "length" and summary.generation_tokens == case["max_tokens"]
    for out in outs[1:]:
        assert 1 <= out.stats.emitted <= case["L"]
        assert out.stats.tree_size <= 1 + case["W"] * (case["L"] - 1)
    if case["drafter"] == "oracle" and not (case["lookup"] and case["W"] == 1):
        # Long accepted runs: the oracle's beam 0 is always right, so every step emits L tokens
        # (a lookup draft takes the place of the last beam, which at W=1 is the oracle's).
        assert summary.steps == -(-(case["max_tokens"] - 1) // case["L"]), summary


def test_cases_cover_the_space():
    cases = [make_case(i) for i in range(N_CASES)]
    assert {c["W"] for c in cases} == set(range(1, 9))
    assert {c["L"] for c in cases} == set(range(2, 7))
    assert {c["drafter"] for c in cases} == {"oracle", "random"}
    assert {c["family"] for c in cases} == set(FAMILIES)
    assert {c["lookup"] for c in cases} == {0, 1, 2, 3}


def test_lookup_drafts_are_verified_and_accepted():
    """Tiny greedy models fall into loops, which prompt lookup copies: its drafts must be
    used and accepted in these cases (so the equality above covers them)."""
    used = accepted = 0
    for i in range(N_CASES):
        case = make_case(i)
        if case["drafter"] == "random" and case["lookup"] and case["W"] == 1:
            _, _, outs = run(case)
            used += sum(o.stats.looked_up for o in outs)
            accepted += sum(o.stats.accepted for o in outs if o.stats.looked_up)
            assert outs[-1].summary.lookup_steps == sum(o.stats.looked_up for o in outs)
    assert used > 0 and accepted > 0


def test_random_drafters_accept_sometimes():
    """Random drafters on a 64-token vocab still hit now and then: the accept path runs."""
    accepted = 0
    for i in range(N_CASES):
        case = make_case(i)
        if case["drafter"] == "random" and case["W"] >= 4:
            _, _, outs = run(case)
            accepted += sum(o.stats.accepted for o in outs)
    assert accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_token_inside_accepted_run(family):
    model, llm = model_for(family, 0)
    prompt = [3, 1, 4, 1, 5]
    ref = reference(family, 0, tuple(prompt), 40)
    # A stop token first produced mid-way: with oracle drafts it sits inside an accepted run.
    k = next(k for k in range(5, 40) if ref[k] not in ref[:k])
    stop = ref[k]
    propose = OracleProposer(llm, prompt, ref, 3, 6, VOCAB)
    outs = list(stream_redrafter(llm, propose, prompt, max_tokens=40, stop_tokens=[stop]))
    got = [t for o in outs for t in o.tokens]
    assert got == ref[:k]
    assert outs[-1].summary.finish_reason == "stop"
    assert any(o.stats.accepted > o.stats.emitted - 1 for o in outs), "stop was not mid-run"
    ar = list(stream_autoregressive(model, prompt, max_tokens=40, stop_tokens=[stop]))
    assert [t for o in ar for t in o.tokens] == ref[:k]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
def test_max_tokens_is_exact(max_tokens):
    model, llm = model_for("qwen2", 1)
    prompt = [9, 8, 7]
    ref = reference("qwen2", 1, tuple(prompt), 20)
    propose = OracleProposer(llm, prompt, ref, 2, 5, VOCAB)
    outs = list(stream_redrafter(llm, propose, prompt, max_tokens=max_tokens))
    assert [t for o in outs for t in o.tokens] == ref[:max_tokens]
    assert outs[-1].summary.generation_tokens == max_tokens
    assert outs[-1].summary.finish_reason == "length"


def test_stop_token_first():
    model, llm = model_for("llama", 0)
    prompt = [5, 6]
    ref = reference("llama", 0, tuple(prompt), 4)
    outs = list(
        stream_redrafter(
            llm, OracleProposer(llm, prompt, ref, 2, 3, VOCAB), prompt, stop_tokens=[ref[0]]
        )
    )
    assert [t for o in outs for t in o.tokens] == []
    assert outs[-1].summary.finish_reason == "stop"


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_holds_exactly_the_accepted_path(family):
    """After every step: offset == prompt + generated - 1 and the entries equal a fresh prefill."""
    model, llm = model_for(family, 0)
    prompt = list(range(10, 19))
    ref = reference(family, 0, tuple(prompt), 30)
    drafter = tiny_drafter(32, VOCAB, seed=3)
    propose = make_proposer(drafter, llm.embed, 4, 4)
    oracle = OracleProposer(llm, prompt, ref, 4, 4, VOCAB)
    for name, prop in [("random", propose), ("oracle", oracle)]:
        cache = llm.make_cache(window_slack=1)
        generated: list[int] = []
        for out in stream_redrafter(llm, prop, prompt, max_tokens=30, cache=cache):
            generated += out.tokens
            seen = prompt + generated[:-1]
            for c in cache:
                assert c.length == len(seen), name
            fresh = llm.make_cache(window_slack=10**6)
            llm.hidden_states(mx.array(seen), fresh, positions=0)
            for c, f in zip(cache, fresh, strict=True):
                k, _ = c.keys_and_values() if c.offset else (None, None)
                fk, _ = f.keys_and_values()
                fk = fk[..., c.start :, :]  # the window cache keeps only recent entries
                np.testing.assert_allclose(np.array(k), np.array(fk), rtol=1e-4, atol=1e-4)
        assert generated == ref


def test_long_prompt_chunked_prefill_crosses_window():
    model, llm = model_for("gemma3_text", 1)
    prompt = list(np.random.default_rng(5).integers(0, VOCAB, size=45))  # window is 6
    ref = reference("gemma3_text", 1, tuple(int(t) for t in prompt), 24)
    drafter = tiny_drafter(32, VOCAB, seed=9)
    outs = stream_redrafter(
        llm,
        make_proposer(drafter, llm.embed, 3, 4),
        prompt,
        max_tokens=24,
        cache=llm.make_cache(window_slack=2),
        prefill_step_size=7,
    )
    assert [t for o in outs for t in o.tokens] == ref


def test_bad_arguments():
    _, llm = model_for("llama", 0)
    propose = make_proposer(tiny_drafter(32, VOCAB), llm.embed, 2, 3)
    with pytest.raises(ValueError, match="prompt is empty"):
        next(stream_redrafter(llm, propose, []))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        next(stream_redrafter(llm, propose, [1], max_tokens=0))


def test_runs_on_mlx_lm_generation_stream():
    """Each step runs on mlx-lm's generation stream (the one its AR decoding uses, so the two
    share one CPU worker thread and its BLAS threads), and the caller's stream is left alone."""
    from mlx_lm.generate import generation_stream

    device = mx.default_device()
    with mx.stream(generation_stream):
        expected = mx.default_stream(device)
    caller = mx.default_stream(device)
    assert expected != caller
    model, llm = model_for("llama", 0)
    inner = make_proposer(tiny_drafter(32, VOCAB, seed=0), llm.embed, 2, 3)
    seen = []

    def propose(hidden, g0):
        seen.append(mx.default_stream(device))
        return inner(hidden, g0)

    for _ in stream_redrafter(llm, propose, [1, 2, 3], max_tokens=12):
        assert mx.default_stream(device) == caller
    assert len(seen) > 1 and all(s == expected for s in seen)


def test_profile_times_every_phase_and_changes_nothing():
    case = make_case(1) | {"drafter": "random"}
    model, llm = model_for(case["family"], case["seed"])
    drafter = tiny_drafter(32, VOCAB, seed=3)
    propose = make_proposer(drafter, llm.embed, 2, 4)
    prompt = list(case["prompt"])
    plain = list(stream_redrafter(llm, propose, prompt, max_tokens=24))
    profiled = list(stream_redrafter(llm, propose, prompt, max_tokens=24, profile=True))
    assert [o.tokens for o in profiled] == [o.tokens for o in plain]
    assert all(o.stats.phases is None for o in plain)
    for out in profiled[1:]:
        phases = out.stats.phases
        assert list(phases) == ["tree", "verify", "accept", "draft", "commit"]
        assert all(t >= 0 for t in phases.values())
        assert sum(phases.values()) <= out.stats.time


def mlx_lm_greedy(logits: mx.array) -> list[int]:
    """What mlx-lm's greedy sampler takes: argmax of the log-probabilities."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).tolist()


def test_a_near_tie_that_the_log_softmax_breaks_is_flagged():
    """1 - 2^-24 and 1 round to the same log-probability: mlx-lm takes index 0, the plain
    argmax index 1. greedy_targets must not be trusted there."""
    logits = mx.array([[1.0 - 2**-24, 1.0] + [0.0] * 20000])
    assert mlx_lm_greedy(logits) == [0]
    targets, unsure = greedy_targets(logits)
    assert targets.tolist() == [1] and unsure.item()
    assert node_targets(logits, SamplingParams()).tolist() == [0]


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 6),
    vocab=st.integers(2, 3000),
    ties=st.lists(st.floats(0, 4 * NEAR_TIE), max_size=3),
    scale=st.sampled_from([1.0, 10.0, 60.0]),
)
def test_greedy_targets_equal_mlx_lms_unless_flagged(seed, rows, vocab, ties, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    for i, gap in enumerate(ties):  # values near each row's maximum
        x[:, rng.integers(vocab)] = x.max(axis=1) - np.float32(gap) * (i % 2)
    logits = mx.array(x)
    targets, unsure = greedy_targets(logits)
    if not unsure.item():
        assert targets.tolist() == mlx_lm_greedy(logits)


def test_a_flagged_step_is_redone_with_mlx_lms_argmax(monkeypatch):
    """Force the rare path with wrong guesses: the output must still be mlx-lm's."""

    def wrong_and_unsure(logits):
        return (mx.argmax(logits, axis=-1) + 1).astype(mx.int32), mx.array(True)

    monkeypatch.setattr(redrafter_mlx.generate, "greedy_targets", wrong_and_unsure)
    for i in range(8):
        case = make_case(i)
        got, ref, _ = run(case)
        assert got == ref, case


def test_solo_lookup_skips_the_drafter():
    """At W=1 a lookup match replaces the only beam: the drafter runs only on the other steps."""
    family, seed, L = "qwen2", 0, 3
    model, llm = model_for(family, seed)
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    ref = reference(family, seed, tuple(prompt), 40)
    drafter = tiny_drafter(32, VOCAB, seed=3)
    inner = make_proposer(drafter, llm.embed, 1, L)
    calls = []

    def propose(hidden, g0):
        calls.append(1)
        return inner(hidden, g0)

    outs = list(stream_redrafter(llm, propose, prompt, max_tokens=40, lookup=1))
    assert [t for out in outs for t in out.tokens] == ref
    steps = [out.stats for out in outs[1:]]
    looked_up = [s for s in steps if s.looked_up]
    assert looked_up and len(looked_up) < len(steps), "the case must mix both kinds of step"
    # The first draft is made with the prompt; later ones only where the lookup missed.
    assert len(calls) == 1 + sum(not s.looked_up for s in steps[1:])
    assert all(s.tree_size <= L for s in steps)


def test_profile_means_count_a_skipped_phase_as_zero():
    """In solo mode the draft runs on some steps only: its mean per step counts the rest as 0,
    and the phases keep the profile's order."""
    from redrafter_mlx.benchmark import consume
    from redrafter_mlx.generate import GenerationSummary, StepOutput, StepStats

    summary = GenerationSummary(generation_tokens=3, steps=2, generation_time=1.0)
    times = {"tree": 0.001, "verify": 0.010, "accept": 0.001, "commit": 0.001}
    outs = [
        StepOutput([1], StepStats(1, 0, 0, 0.1), summary),  # the prompt
        StepOutput([2], StepStats(1, 0, 3, 0.1, phases=dict(times)), summary),
        StepOutput([3], StepStats(1, 0, 3, 0.1, phases={"draft": 0.004, **times}), summary),
    ]
    result = consume("solo", 0, iter(outs))
    assert list(result.phase_ms) == ["tree", "verify", "accept", "draft", "commit"]
    assert result.phase_ms["draft"] == pytest.approx(2.0)
    assert result.phase_ms["verify"] == pytest.approx(10.0)
