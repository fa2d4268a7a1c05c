"""Drafter training: data generation with hidden states, the objective, resume, data parallel."""

import json
import subprocess
import sys
import types
from pathlib import Path

from redrafter_mlx.distill_data import generate_dataset, greedy_with_hidden
from redrafter_mlx.generate import stream_autoregressive
from redrafter_mlx.training import (
    TrainConfig,
    choose_draft_vocab,
    draft_vocab_index,
    drafter_loss,
    evaluate,
    new_drafter,
    train,
)

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import FAMILIES, tiny_llm
from training_data import tiny_setup

HERE = Path(__file__).parent


def weights(drafter) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(drafter.parameters())}


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_answers_and_hidden_states(family):
    model = tiny_llm(family, vocab_size=64, seed=1, window=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 9, 5, 12)]
    stop = {7}
    for prompt, (answer, hidden) in zip(
        prompts, greedy_with_hidden(model, prompts, 20, stop), strict=True
    ):
        ref = stream_autoregressive(model, prompt, max_tokens=20, stop_tokens=stop)
        assert answer == [t for o in ref for t in o.tokens]
        full = np.array(model.model(mx.array(prompt + answer)[None])[0])
        expected = full[len(prompt) - 1 : len(prompt) - 1 + len(answer)]
        np.testing.assert_allclose(hidden.astype(np.float32), expected, atol=1e-2, rtol=1e-2)


def test_generate_dataset_is_cached_and_resumable(tmp_path, monkeypatch):
    model = tiny_llm("qwen2", vocab_size=64, seed=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    samples, hidden = generate_dataset(model, prompts, tmp_path, {0}, max_tokens=6, batch_size=2)
    assert [s.prompt for s in samples] == prompts
    assert all(hidden[i].shape == (len(s.answer), 32) for i, s in enumerate(samples) if s.answer)
    # Lose the last batch, as an interrupted run would; only that batch is generated again.
    lines = (tmp_path / "generations.jsonl").read_text().splitlines()
    (tmp_path / "generations.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    calls = []
    real = greedy_with_hidden

    def counting(model, batch, *a):
        calls.append(batch)
        return real(model, batch, *a)

    monkeypatch.setattr("redrafter_mlx.distill_data.greedy_with_hidden", counting)
    again, hidden2 = generate_dataset(model, prompts, tmp_path, {0}, max_tokens=6, batch_size=2)
    assert len(calls) == 1 and [s.answer for s in again] == [s.answer for s in samples]
    with pytest.raises(ValueError, match="other prompts"):
        generate_dataset(model, [[9, 9]] + prompts[1:], tmp_path, {0}, 6, 2)


def test_generate_dataset_cache_does_not_depend_on_the_batch_size(tmp_path, monkeypatch):
    """A cached folder reused with another --gen-batch regenerates nothing and mixes nothing
    (shards were once named by batch number, so a new batch size re-answered prompts)."""
    model = tiny_llm("qwen2", vocab_size=64, seed=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]
    samples, hidden = generate_dataset(model, prompts, tmp_path, {0}, max_tokens=6, batch_size=4)
    calls = []
    real = greedy_with_hidden

    def counting(model, batch, *a):
        calls.append(batch)
        return real(model, batch, *a)

    monkeypatch.setattr("redrafter_mlx.distill_data.greedy_with_hidden", counting)
    again, hidden2 = generate_dataset(model, prompts, tmp_path, {0}, max_tokens=6, batch_size=2)
    assert calls == []
    assert [s.answer for s in again] == [s.answer for s in samples]
    assert (
        all(np.array_equal(hidden[i], hidden2[i]) for i in hidden)
        and hidden.keys() == hidden2.keys()
    )
    # Interrupted after three answers: the rest come in new shards, old shards stay as they were.
    lines = (tmp_path / "generations.jsonl").read_text().splitlines()
    (tmp_path / "generations.jsonl").write_text("\n".join(lines[:3]) + "\n")
    shards = {p.name: p.read_bytes() for p in tmp_path.glob("hidden-*.safetensors")}
    third, hidden3 = generate_dataset(model, prompts, tmp_path, {0}, max_tokens=6, batch_size=2)
    assert sum(map(len, calls)) == 3 and len(calls) == 2
    assert all(tmp_path.joinpath(n).read_bytes() == b for n, b in shards.items())
    assert len(list(tmp_path.glob("hidden-*.safetensors"))) == len(shards) + 2
    assert [s.answer for s in third] == [s.answer for s in samples]
    for i, s in enumerate(third):
        assert hidden3[i].shape == (len(s.answer), 32)
        np.testing.assert_allclose(hidden3[i], hidden[i], atol=1e-3)


def reference_drafts(drafter, embed, e, K: int):
    """(j, k, logits [V_d]) at every position j and horizon k whose target x_{j+k} is in the
    draft vocabulary: the RNN run over x_j .. x_{j+k-1} one token at a time, conditioned on
    the hidden state at j (the per-position reference the batched loss must match)."""
    vocab_index = draft_vocab_index(drafter.config)
    T = len(e.tokens)
    for j in range(T):
        state = mx.zeros((1, drafter.config.hidden_size))
        for k in range(1, min(K, T - 1 - j) + 1):
            state = drafter.step(state, embed(mx.array([int(e.tokens[j + k - 1])])))
            if vocab_index[e.tokens[j + k]] >= 0:
                yield j, k, drafter.logits(mx.array(e.hidden[j : j + 1]), state)[0]


def test_loss_matches_a_per_position_reference():
    drafter, embed, examples, cfg = tiny_setup()
    vocab_index = draft_vocab_index(drafter.config)
    e = examples[0]
    T, K = len(e.tokens), cfg.horizons
    tokens = mx.array(e.tokens[None])
    hidden = mx.array(e.hidden[None])
    targets = mx.array(vocab_index[e.tokens][None])
    valid = mx.ones((1, T), mx.bool_)
    loss, stats = drafter_loss(drafter, embed(tokens), hidden, targets, valid, K)
    per_h = [[] for _ in range(K)]
    for j, k, logits in reference_drafts(drafter, embed, e, K):
        t = vocab_index[e.tokens[j + k]]
        per_h[k - 1].append(float(mx.logsumexp(logits) - logits[t]))
    want = sum(np.mean(h) for h in per_h)
    assert float(loss) == pytest.approx(want, rel=1e-4)
    assert [int(n) for _, n in stats] == [len(h) for h in per_h]


def test_kl_term_matches_a_per_position_reference():
    """kl_weight adds, at every horizon k and position j, KL(LLM || drafter) with the LLM's
    distribution for x_{j+k} taken from the hidden state at j + k (the one that produced it)."""
    drafter, embed, examples, cfg = tiny_setup()
    vocab_index = draft_vocab_index(drafter.config)
    e = examples[0]
    T, K = len(e.tokens), cfg.horizons
    head = mx.random.normal((drafter.config.output_size, 16), key=mx.random.key(3))
    args = (
        embed(mx.array(e.tokens[None])),
        mx.array(e.hidden[None]),
        mx.array(vocab_index[e.tokens][None]),
        mx.ones((1, T), mx.bool_),
        K,
    )
    ce, _ = drafter_loss(drafter, *args)
    loss, _ = drafter_loss(drafter, *args, llm_head=head, kl_weight=0.5)
    per_h = [[] for _ in range(K)]
    for j, k, logits in reference_drafts(drafter, embed, e, K):
        log_q = np.array(logits - mx.logsumexp(logits))
        teacher = head @ mx.array(e.hidden[j + k])
        log_p = np.array(teacher - mx.logsumexp(teacher))
        per_h[k - 1].append(float((np.exp(log_p) * (log_p - log_q)).sum()))
    kl = sum(np.mean(h) for h in per_h)
    assert kl > 0.1
    assert float(loss) == pytest.approx(float(ce) + 0.5 * kl, rel=1e-4)


def test_draft_vocab_choice_and_coverage():
    _, _, examples, _ = tiny_setup()
    vocab, coverage = choose_draft_vocab(examples, 5, vocab_size=40)
    counts = np.bincount(np.concatenate([e.tokens for e in examples]), minlength=40)
    assert len(vocab) == 5 and vocab == sorted(vocab)
    assert coverage == pytest.approx(counts[vocab].sum() / counts.sum())
    assert set(vocab) == set(np.argsort(-counts, kind="stable")[:5].tolist())
    assert choose_draft_vocab(examples, 40, vocab_size=40) == (None, 1.0)


def test_training_learns():
    drafter, embed, examples, cfg = tiny_setup(steps=60)
    before = evaluate(drafter, embed, examples, cfg.horizons, cfg.window)
    drafter, state = train(drafter, embed, examples, cfg)
    after = evaluate(drafter, embed, examples, cfg.horizons, cfg.window)
    assert state.history[-1]["loss"] < 0.5 * state.history[0]["loss"]
    assert min(after) > 0.8 and max(before) < 0.5, (before, after)


def test_resume_continues_exactly(tmp_path):
    drafter, embed, examples, cfg = tiny_setup(steps=6)
    straight, _ = train(drafter, embed, examples, cfg)
    drafter, embed, examples, cfg = tiny_setup(steps=3)
    train(drafter, embed, examples, cfg, checkpoint_dir=tmp_path)
    drafter, embed, examples, cfg = tiny_setup(steps=6)
    resumed, state = train(drafter, embed, examples, cfg, checkpoint_dir=tmp_path, resume=True)
    assert state.step == 6
    for k, v in weights(straight).items():
        np.testing.assert_allclose(weights(resumed)[k], v, rtol=1e-5, atol=1e-6)


def test_grad_accumulation_equals_one_big_batch():
    big, _ = train(*tiny_setup(grad_accum=1))
    acc, _ = train(*tiny_setup(grad_accum=4))
    for k, v in weights(big).items():
        np.testing.assert_allclose(weights(acc)[k], v, rtol=1e-4, atol=1e-5)


def test_two_processes_match_one(tmp_path):
    """mlx.launch -n 2 on localhost: both ranks end equal, and equal to one process."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed")
    r = subprocess.run(
        [
            str(launcher),
            "-n",
            "2",
            "--python",
            sys.executable,
            str(HERE / "dist_train_worker.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [mx.load(str(tmp_path / f"rank{i}-of-2.safetensors")) for i in range(2)]
    single, _ = train(*tiny_setup())
    for k, v in weights(single).items():
        assert np.array_equal(np.array(ranks[0][k]), np.array(ranks[1][k])), k
        np.testing.assert_allclose(np.array(ranks[0][k]), v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_tokens_per_step_equal_the_engine(family):
    """The card's offline tokens/step (drafter only) equals the real engine's, step for step."""
    from redrafter_mlx.acceptance import replay
    from redrafter_mlx.beam_search import make_proposer
    from redrafter_mlx.generate import stream_redrafter
    from redrafter_mlx.llm import TreeLLM

    from tiny_models import tiny_drafter

    model = tiny_llm(family, vocab_size=16, seed=4, window=64)
    llm = TreeLLM(model)
    drafter = tiny_drafter(32, 16, seed=5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    answers, hidden = zip(*greedy_with_hidden(model, prompts, 30, set()), strict=True)
    total = 0
    for W, L in [(1, 3), (3, 4), (4, 6)]:
        replayed = replay(drafter, llm.embed, list(answers), list(hidden), W, L)
        for prompt, answer, accepted in zip(prompts, answers, replayed, strict=True):
            propose = make_proposer(drafter, llm.embed, W, L)
            outs = list(stream_redrafter(llm, propose, prompt, max_tokens=len(answer)))
            assert [t for o in outs for t in o.tokens] == answer
            engine = [o.stats.accepted for o in outs[1:]]
            assert accepted[:-1] == engine[:-1]  # the engine's last step may accept past the end
            assert len(accepted) == outs[-1].summary.steps
            total += sum(accepted)
    assert total > 0  # a 16-token vocabulary: drafts do get accepted, so the replay is tested


def test_shrinking_the_draft_vocab_keeps_the_frequent_rows():
    from redrafter_mlx.training import shrink_draft_vocab

    drafter, embed, examples, cfg = tiny_setup()
    small = shrink_draft_vocab(drafter, examples, 6)
    counts = np.bincount(np.concatenate([e.tokens for e in examples]), minlength=40)
    old = drafter.config.draft_vocab
    expected = sorted(sorted(old, key=lambda t: (-counts[t], old.index(t)))[:6])
    assert small.config.draft_vocab == expected
    rows = [old.index(t) for t in expected]
    head_old, head_new = drafter.lm_head[-1].weight, small.lm_head[-1].weight
    assert mx.array_equal(head_new, head_old[mx.array(rows)])
    h, s = mx.random.normal((2, 16)), mx.random.normal((2, 16))
    assert mx.allclose(small.logits(h, s), drafter.logits(h, s)[:, mx.array(rows)], atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_head_init_starts_at_the_llms_own_guess(family):
    """head_init='llm': before training, the draft logits are the LLM's next-token logits
    over the draft vocabulary, whatever the RNN state."""
    from redrafter_mlx.adapters import adapter_for
    from redrafter_mlx.training import init_head_from_llm

    model = tiny_llm(family)
    adapter = adapter_for(model)
    V, H = adapter.output_embeddings(model).shape
    vocab = list(range(1, V, 3))
    drafter = new_drafter(TrainConfig(), H, V, vocab)
    init_head_from_llm(drafter, adapter.output_embeddings(model)[mx.array(vocab)])
    h = mx.random.normal((3, H))
    state = drafter.step(mx.random.normal((3, H)), mx.random.normal((3, H)))
    want = adapter.lm_head(model, h)[:, mx.array(vocab)]
    np.testing.assert_allclose(np.array(drafter.logits(h, state)), np.array(want), atol=1e-4)
    with pytest.raises(ValueError, match="expected LLM rows"):
        init_head_from_llm(drafter, adapter.output_embeddings(model))


def test_cached_prompts_extend_or_refuse(tmp_path, monkeypatch):
    """A data folder's cached prompts are kept when a run asks for more of the same corpus
    (--num-prompts raised), and refused, with what to do, when they are not what it asks for."""
    from redrafter_mlx import distill_data, recipe

    class Stop(Exception):
        pass

    seen = []

    def fake_generate(model, prompts, folder, **kw):
        seen.append(list(prompts))
        raise Stop

    monkeypatch.setattr(distill_data, "generate_dataset", fake_generate)
    monkeypatch.setattr(
        distill_data, "build_prompts", lambda tok, n, seed, **kw: [[seed, i] for i in range(n)]
    )

    def prepare(n: int, seed: int = 0) -> list:
        r = recipe.Recipe(num_prompts=n, train=TrainConfig(seed=seed))
        tokenizer = types.SimpleNamespace(eos_token_ids=[0])
        with pytest.raises(Stop):
            recipe.prepare_data(None, tokenizer, r, tmp_path, log=lambda m: None)
        return seen[-1]

    assert prepare(4) == [[0, i] for i in range(4)]
    assert prepare(6) == [[0, i] for i in range(6)]  # extended, the first four unchanged
    cached = (tmp_path / "prompts.jsonl").read_text().splitlines()
    assert len(cached) == 6
    for n, seed in ((3, 0), (6, 1)):
        with pytest.raises(ValueError, match="holds 6 prompts .* use a new --work-dir"):
            prepare(n, seed)
    assert (tmp_path / "prompts.jsonl").read_text().splitlines() == cached


def test_fresh_prompts_skip_every_earlier_stage(tmp_path, monkeypatch):
    """--fresh-prompts draws stdlib prompts that none of the continued drafter's stages used
    (a fresh stage's own picks included), reproducibly from the reports alone."""
    from redrafter_mlx import distill_data, recipe

    corpus = tuple(f"def f{i}():\n    'doc'" for i in range(40))
    monkeypatch.setattr(distill_data, "_stdlib_snippets", lambda: corpus)

    def stage(n, seed, **kw) -> dict:
        return {"num_prompts": n, "train": {"seed": seed}, **kw}

    one = set(distill_data.stdlib_snippets(10, 0))
    two = set(distill_data.stdlib_snippets(10, 1, exclude=one))
    assert len(one) == len(two) == 10 and not one & two
    stages = [stage(10, 0), stage(10, 1, fresh_prompts=True), stage(99, 5, prompts_file="x")]
    assert distill_data.snippets_used_by(stages) == one | two
    # Stages that were not fresh may repeat prompts: the used set is their union.
    assert distill_data.snippets_used_by([stage(10, 0), stage(10, 0)]) == one
    with pytest.raises(ValueError, match="20 excluded.*lower --num-prompts"):
        distill_data.stdlib_snippets(21, 2, exclude=one | two)

    seen = []

    def fake_build(tok, n, seed, chat_share, exclude):
        seen.append((chat_share, set(exclude)))
        return [[seed, i] for i in range(n)]

    class Stop(Exception):
        pass

    def fake_generate(*a, **kw):
        raise Stop

    monkeypatch.setattr(distill_data, "build_prompts", fake_build)
    monkeypatch.setattr(distill_data, "generate_dataset", fake_generate)
    parent = tmp_path / "parent"
    parent.mkdir()
    report = {"recipe": {**stage(10, 1, fresh_prompts=True), "init_drafter": "g"}}
    report["init_report"] = {"recipe": stage(10, 0)}
    (parent / "report.json").write_text(json.dumps(report))
    tokenizer = types.SimpleNamespace(eos_token_ids=[0])
    fresh = recipe.Recipe(num_prompts=5, fresh_prompts=True, chat_share=0.0)
    fresh.init_drafter = str(parent)
    with pytest.raises(Stop):
        recipe.prepare_data(None, tokenizer, fresh, tmp_path / "d", log=lambda m: None)
    assert seen == [(0.0, one | two)]
    # Fresh prompts need a drafter whose report names what it used; a prompts file is not
    # combined with stdlib choices.
    for bad, match in (
        (recipe.Recipe(fresh_prompts=True), "pass --init-drafter"),
        (recipe.Recipe(fresh_prompts=True, init_drafter=str(tmp_path)), "no .*report.json"),
        (recipe.Recipe(prompts_file="p.jsonl", chat_share=0.0), "drop one or the other"),
    ):
        with pytest.raises(ValueError, match=match):
            recipe.prepare_data(None, tokenizer, bad, tmp_path / "e", log=lambda m: None)


def test_answered_only_uses_the_folder_as_it_is(tmp_path, monkeypatch):
    """--answered-only trains on what an interrupted data run answered: nothing is generated,
    unanswered prompts come back empty (so they are not trained on), answered ones intact."""
    model = tiny_llm("qwen2", vocab_size=64, seed=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    samples, hidden = generate_dataset(model, prompts, tmp_path, {0}, max_tokens=6, batch_size=2)
    lines = (tmp_path / "generations.jsonl").read_text().splitlines()
    (tmp_path / "generations.jsonl").write_text("\n".join(lines[:3]) + "\n")
    kept = {json.loads(x)["index"] for x in lines[:3]}
    calls = []
    monkeypatch.setattr(
        "redrafter_mlx.distill_data.greedy_with_hidden", lambda *a: calls.append(a) or []
    )
    again, hidden2 = generate_dataset(model, prompts, tmp_path, {0}, 6, 2, answer_new=False)
    assert calls == []
    assert [s.prompt for s in again] == prompts
    want = [s.answer if i in kept else [] for i, s in enumerate(samples)]
    assert [s.answer for s in again] == want
    assert set(hidden2) == kept & set(hidden)
    assert all(np.array_equal(hidden2[i], hidden[i]) for i in hidden2)
    # An empty folder has nothing to train on: said so, with the way out.
    from redrafter_mlx import recipe

    empty = tmp_path / "empty"
    tokenizer = types.SimpleNamespace(eos_token_ids=[0])
    monkeypatch.setattr(
        "redrafter_mlx.distill_data.build_prompts", lambda tok, n, seed, **kw: prompts
    )
    r = recipe.Recipe(num_prompts=5, answered_only=True)
    with pytest.raises(ValueError, match="no answered prompts .*drop --answered-only"):
        recipe.prepare_data(model, tokenizer, r, empty, log=lambda m: None)


def test_held_out_are_the_last_answered_prompts():
    from redrafter_mlx.recipe import held_out_ids

    ex = {i: None for i in (0, 3, 7, 8, 20, 31, 40, 41, 50, 60)}
    assert held_out_ids(ex, 1) == [60]
    assert held_out_ids(ex, 24) == [50, 60]  # at most a fifth
    assert held_out_ids({5: None}, 24) == [5]


def test_prompts_are_answered_near_corpus_order(tmp_path, monkeypatch):
    """Length sorting stays within groups of batches, so a data run stopped early has answered
    the corpus's first prompts, not only its shortest ones (a biased sample)."""
    from redrafter_mlx import distill_data

    model = tiny_llm("qwen2", vocab_size=64, seed=2)
    prompts = [[1] * n for n in (5, 4, 3, 2, 1, 6)]
    order = []
    real = greedy_with_hidden

    def recording(model, batch, *a):
        order.extend(prompts.index(p) for p in batch)
        return real(model, batch, *a)

    monkeypatch.setattr(distill_data, "greedy_with_hidden", recording)
    monkeypatch.setattr(distill_data, "GROUP_BATCHES", 2)
    generate_dataset(model, prompts, tmp_path, {0}, max_tokens=2, batch_size=1)
    assert order == [1, 0, 3, 2, 4, 5]  # sorting all first gave [4, 3, 2, 1, 0, 5]
