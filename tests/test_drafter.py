"""The recurrent drafter and its beam search."""

import json

from redrafter_mlx.beam_search import beam_search, make_proposer, top_k_warp
from redrafter_mlx.drafter import Drafter, DrafterConfig

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import tiny_drafter


def np_params(drafter):
    return {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}


def silu(x):
    return x / (1 + np.exp(-x))


def np_logits(p, cfg, h, s):
    """Apple's head in NumPy: lm_head(input_proj?(concat[h, s]))."""
    x = np.concatenate([h, s], axis=-1)
    if "input_proj.weight" in p:
        x = x @ p["input_proj.weight"].T + p["input_proj.bias"]
    for i in range(cfg.num_draft_layers):
        x = x + silu(x @ p[f"lm_head.{i}.linear.weight"].T + p[f"lm_head.{i}.linear.bias"])
    return x @ p[f"lm_head.{cfg.num_draft_layers}.weight"].T


def np_step(p, cfg, s, e):
    if cfg.rnn:
        return silu(e @ p["rnn_w.weight"].T + s @ p["rnn_u.weight"].T + p["rnn_u.bias"])
    return s + e


def test_parameter_names_match_apple():
    d = Drafter(DrafterConfig(vocab_size=50, hidden_size=8, num_draft_layers=2))
    shapes = {k: v.shape for k, v in tree_flatten(d.parameters())}
    assert shapes == {
        "rnn_w.weight": (8, 8),
        "rnn_u.weight": (8, 8),
        "rnn_u.bias": (8,),
        "lm_head.0.linear.weight": (16, 16),
        "lm_head.0.linear.bias": (16,),
        "lm_head.1.linear.weight": (16, 16),
        "lm_head.1.linear.bias": (16,),
        "lm_head.2.weight": (50, 16),
    }
    d = Drafter(DrafterConfig(vocab_size=50, hidden_size=8, exit_dim=12, num_draft_layers=1))
    shapes = {k: v.shape for k, v in tree_flatten(d.parameters())}
    assert shapes["input_proj.weight"] == (12, 16) and shapes["input_proj.bias"] == (12,)
    assert shapes["lm_head.1.weight"] == (50, 12)
    d = Drafter(DrafterConfig(vocab_size=50, hidden_size=8, rnn=False, draft_vocab=[1, 4, 9]))
    keys = {k for k, _ in tree_flatten(d.parameters())}
    assert not any(k.startswith("rnn") for k in keys)
    assert d.lm_head[-1].weight.shape == (3, 16)


@pytest.mark.parametrize("rnn,exit_dim", [(True, None), (False, None), (True, 24)])
def test_forward_matches_numpy_reference(rnn, exit_dim):
    cfg = DrafterConfig(vocab_size=40, hidden_size=16, exit_dim=exit_dim, rnn=rnn)
    drafter = tiny_drafter(16, 40, rnn=rnn, exit_dim=exit_dim)
    p = np_params(drafter)
    rng = np.random.default_rng(1)
    h = rng.normal(size=(3, 16)).astype(np.float32)
    emb = rng.normal(size=(3, 5, 16)).astype(np.float32)
    got = np.array(drafter(mx.array(h), mx.array(emb)))
    s = np.zeros((3, 16))
    for t in range(5):
        s = np_step(p, cfg, s, emb[:, t].astype(np.float64))
        np.testing.assert_allclose(got[:, t], np_logits(p, cfg, h, s), rtol=1e-4, atol=1e-4)


def test_config_validation_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="strictly increasing"):
        DrafterConfig(vocab_size=10, hidden_size=4, draft_vocab=[3, 2])
    with pytest.raises(ValueError, match=r"lie in \[0, 10\)"):
        DrafterConfig(vocab_size=10, hidden_size=4, draft_vocab=[3, 10])
    with pytest.raises(ValueError, match="missing required field"):
        DrafterConfig.from_dict({"vocab_size": 10})
    d = tiny_drafter(8, 30, draft_vocab=[0, 3, 7, 29])
    d.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["model_type"] == "recurrent_drafting_drafter" and cfg["exit_dim"] == 16
    loaded = Drafter.from_pretrained(tmp_path / "d")
    assert loaded.config.draft_vocab == [0, 3, 7, 29]
    for (k, a), (_, b) in zip(
        tree_flatten(d.parameters()), tree_flatten(loaded.parameters()), strict=True
    ):
        assert mx.array_equal(a, b), k
    assert loaded.token_ids(mx.array([0, 2, 3])).tolist() == [0, 7, 29]


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        Drafter.from_pretrained(tmp_path)
    d = tiny_drafter(8, 30)
    d.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["hidden_size"] = 10
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weights do not match"):
        Drafter.from_pretrained(tmp_path / "d")


def reference_beam_search(drafter, table, h, g0, W, L, top_k=None):
    """Plain-Python beam search over NumPy drafter math (Apple's semantics)."""
    cfg = drafter.config
    p = np_params(drafter)
    beams = [([g0], 0.0, np.zeros(cfg.hidden_size))] + [
        ([g0], -50000.0, np.zeros(cfg.hidden_size)) for _ in range(W - 1)
    ]
    for _ in range(L - 1):
        cands = []
        for bi, (toks, score, s) in enumerate(beams):
            s2 = np_step(p, cfg, s, table[toks[-1]])
            logits = np_logits(p, cfg, h, s2)
            if top_k is not None:
                kth = np.sort(logits)[-top_k]
                logits = np.where(logits < kth, -50000.0, logits)
            logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            for t, lp in enumerate(logp):
                cands.append((score + lp, bi * len(logp) + t, bi, t, s2))
        cands.sort(key=lambda c: (-c[0], c[1]))
        beams = [(beams[bi][0] + [t], sc, s2) for sc, _, bi, t, s2 in cands[:W]]
    return np.array([b[0] for b in beams]), np.array([b[1] for b in beams])


@pytest.mark.parametrize(
    "W,L,top_k", [(1, 2, None), (3, 4, None), (4, 5, 5), (6, 3, None), (8, 4, 3)]
)
def test_beam_search_matches_reference(W, L, top_k):
    V, H = 12, 8
    drafter = tiny_drafter(H, V)
    rng = np.random.default_rng(W * 10 + L)
    table = rng.normal(size=(V, H)).astype(np.float32)
    h = rng.normal(size=(H,)).astype(np.float32)
    embed_table = mx.array(table)
    out = beam_search(drafter, lambda t: embed_table[t], mx.array(h), mx.array(3), W, L, top_k)
    ref_tokens, ref_scores = reference_beam_search(drafter, table, h, 3, W, L, top_k)
    assert out.tokens.shape == (W, L)
    assert out.tokens[:, 0].tolist() == [3] * W
    np.testing.assert_array_equal(np.array(out.tokens), ref_tokens)
    np.testing.assert_allclose(np.array(out.scores), ref_scores, rtol=1e-4, atol=1e-4)
    scores = np.array(out.scores)
    assert np.all(scores[:-1] >= scores[1:])  # best first


def test_beam_search_log_q_and_draft_vocab():
    V, H, W, L = 20, 8, 3, 4
    vocab = [1, 2, 5, 8, 13, 19]
    drafter = tiny_drafter(H, V, draft_vocab=vocab)
    table = mx.random.normal((V, H))
    out = beam_search(
        drafter, lambda t: table[t], mx.random.normal((H,)), mx.array(5), W, L, return_log_q=True
    )
    assert set(np.array(out.tokens[:, 1:]).ravel()) <= set(vocab)
    assert out.log_q.shape == (W, L - 1, len(vocab))
    # Each beam's score is the sum of its own tokens' draft log-probs.
    idx = {t: i for i, t in enumerate(vocab)}
    lq = np.array(out.log_q)
    toks = np.array(out.tokens)
    prefix = np.array(out.prefix_scores)
    assert prefix.shape == (W, L) and np.all(prefix[:, 0] == 0)
    for b in range(W):
        steps = [lq[b, d, idx[toks[b, d + 1]]] for d in range(L - 1)]
        assert abs(sum(steps) - float(out.scores[b])) < 1e-4
        # ... and its prefix score at depth d sums its first d tokens' log-probs.
        np.testing.assert_allclose(prefix[b, 1:], np.cumsum(steps), atol=1e-4)


def test_beam_search_is_deterministic():
    drafter = tiny_drafter(8, 30)
    table = mx.random.normal((30, 8))
    h = mx.random.normal((8,))
    a = beam_search(drafter, lambda t: table[t], h, mx.array(2), 4, 5).tokens
    b = beam_search(drafter, lambda t: table[t], h, mx.array(2), 4, 5).tokens
    assert mx.array_equal(a, b)


def test_top_k_warp():
    x = mx.array([[0.1, 3.0, -1.0, 2.0, 0.5]])
    y = top_k_warp(x, 2)
    assert np.isinf(np.array(y)[0, [0, 2, 4]]).all()
    assert np.array(y)[0, 1] == pytest.approx(3.0)
    assert mx.array_equal(top_k_warp(x, 10), x)


def test_batched_beam_search_equals_one_by_one():
    drafter = tiny_drafter(8, 30, draft_vocab=list(range(0, 30, 2)))
    table = mx.random.normal((30, 8))
    hidden = mx.random.normal((5, 8))
    g0 = mx.array([1, 2, 3, 4, 5])
    out = beam_search(drafter, lambda t: table[t], hidden, g0, 3, 4, return_log_q=True)
    assert out.tokens.shape == (5, 3, 4) and out.log_q.shape == (5, 3, 3, 15)
    for b in range(5):
        one = beam_search(drafter, lambda t: table[t], hidden[b], g0[b], 3, 4, return_log_q=True)
        assert mx.array_equal(out.tokens[b], one.tokens)
        assert mx.allclose(out.scores[b], one.scores, atol=1e-5)
        assert mx.allclose(out.log_q[b], one.log_q, atol=1e-5)


@pytest.mark.parametrize("W,L,top_k", [(1, 4, None), (4, 5, None), (3, 6, 4)])
def test_compiled_proposer_equals_eager_and_sees_new_weights(W, L, top_k):
    drafter = tiny_drafter(8, 40, draft_vocab=list(range(0, 40, 3)))
    table = mx.random.normal((40, 8))
    embed = lambda t: table[t]  # noqa: E731
    eager = make_proposer(drafter, embed, W, L, top_k=top_k, compiled=False)
    fast = make_proposer(drafter, embed, W, L, top_k=top_k, compiled=True)
    for seed in range(5):
        h = mx.random.normal((8,), key=mx.random.key(seed))
        g0 = mx.array(seed % 40)
        assert mx.array_equal(fast(h, g0), eager(h, g0))
    # Weights are compile inputs, not constants: an update (training, set_dtype) is seen.
    h, g0 = mx.random.normal((8,), key=mx.random.key(9)), mx.array(7)
    before = fast(h, g0)
    head = drafter.lm_head[-1]
    head.weight = mx.random.normal(head.weight.shape, key=mx.random.key(11))
    assert mx.array_equal(fast(h, g0), eager(h, g0))
    assert not mx.array_equal(fast(h, g0), before)
