"""One-beam drafting from int8 copies of the drafter's weights (redrafter_mlx/drafter_int8.py).

Its products must be exactly the integer arithmetic it claims (checked against int64 NumPy),
its drafts close to the float32 drafter's, and the engine's output unchanged with it.
"""

import redrafter_mlx  # noqa: F401  (first: loads the kernel and the BLAS)
from redrafter_mlx import _blas
from redrafter_mlx.beam_search import beam_search, make_proposer
from redrafter_mlx.drafter_int8 import Int8Linear, Int8OneBeam
from redrafter_mlx.generate import (
    step_cost,
    stream_autoregressive,
    stream_generate,
    stream_redrafter,
)
from redrafter_mlx.llm import TreeLLM

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import tiny_drafter, tiny_llm

pytestmark = pytest.mark.skipif(
    _blas.gemm != "on", reason=f"the few-row GEMM kernel is not on here ({_blas.gemm})"
)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_the_integer_product_it_claims(bias):
    layer = nn.Linear(200, 300, bias=bias)
    mx.eval(layer.parameters())
    q8 = Int8Linear.from_linear(layer)
    x = np.random.default_rng(0).standard_normal((3, 200)).astype(np.float32) * 5
    x[1] = 0.0  # a zero row: scale 1, product 0 (+ bias)
    got = q8(x)
    amax = np.abs(x).max(axis=1)
    xs = np.where(amax > 0, amax / _blas.int16_limit(200), 1.0).astype(np.float32)
    x16 = np.rint(x / xs[:, None]).astype(np.int64)
    want = ((x16 @ q8.q.astype(np.int64).T).astype(np.float32) * q8.scale[None]) * xs[:, None]
    if bias:
        want = want + np.array(layer.bias)
    np.testing.assert_array_equal(got, want)
    # ... and close to the float32 product.
    exact = x @ np.array(layer.weight).T + (np.array(layer.bias) if bias else 0)
    np.testing.assert_allclose(got, exact, atol=0.02 * np.abs(exact).max())


def test_layers_it_must_not_copy():
    assert Int8Linear.from_linear(nn.Linear(64, 300)) is None  # K < 128: not the kernel's
    assert Int8Linear.from_linear(nn.QuantizedLinear(256, 300)) is None
    broken = nn.Linear(200, 300)
    broken.weight = mx.where(mx.arange(300)[:, None] == 7, mx.inf, broken.weight)
    assert Int8Linear.from_linear(broken) is None


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_half_precision_layer_gives_its_float32_casts_copy(dtype):
    half = nn.Linear(200, 300)
    half.set_dtype(dtype)
    mx.eval(half.parameters())
    wide = nn.Linear(200, 300)
    wide.update(half.parameters())
    wide.set_dtype(mx.float32)
    got, want = Int8Linear.from_linear(half), Int8Linear.from_linear(wide)
    assert got is not None and half.weight.dtype == dtype  # copied, not cast in place
    np.testing.assert_array_equal(got.q, want.q)
    np.testing.assert_array_equal(got.scale, want.scale)
    np.testing.assert_array_equal(got.bias, want.bias)
    assert got.bias.dtype == np.float32


@pytest.mark.parametrize("rnn,vocab", [(True, None), (False, None), (True, "draft")])
def test_drafts_follow_the_float32_drafters(rnn, vocab):
    draft_vocab = list(range(0, 512, 2)) if vocab else None
    drafter = tiny_drafter(128, 512, seed=5, rnn=rnn, draft_vocab=draft_vocab)
    embed = TreeLLM(tiny_llm("qwen2", vocab_size=512, hidden_size=128)).embed
    one_beam = Int8OneBeam.for_drafter(drafter, embed, 4)
    assert one_beam is not None and one_beam.nbytes > 0
    rng = np.random.default_rng(1)
    same = 0
    for _ in range(50):
        h = mx.array(rng.standard_normal(128).astype(np.float32))
        g0 = mx.array(int(rng.integers(0, 512)))
        got = np.array(one_beam(h, g0))
        want = np.array(beam_search(drafter, embed, h, g0, 1, 4).tokens)
        assert got.shape == (1, 4) and got[0, 0] == int(g0.item())
        if draft_vocab is not None:
            assert set(got[0, 1:].tolist()) <= set(draft_vocab)
        same += np.array_equal(got, want)
    assert same >= 45, same  # near ties may go the other way, rarely


def test_make_proposer_uses_it_only_where_it_applies():
    drafter = tiny_drafter(128, 512)
    embed = TreeLLM(tiny_llm("qwen2", vocab_size=512, hidden_size=128)).embed
    assert isinstance(make_proposer(drafter, embed, 1, 3, int8=True), Int8OneBeam)
    assert not isinstance(make_proposer(drafter, embed, 1, 3), Int8OneBeam)
    assert not isinstance(make_proposer(drafter, embed, 2, 3, int8=True), Int8OneBeam)
    assert not isinstance(
        make_proposer(drafter, embed, 1, 3, int8=True, with_scores=True), Int8OneBeam
    )
    narrow = tiny_drafter(32, 64)  # too narrow for the kernel: the float32 search
    embed32 = TreeLLM(tiny_llm("qwen2", vocab_size=64)).embed
    assert not isinstance(make_proposer(narrow, embed32, 1, 3, int8=True), Int8OneBeam)


def repeating_drafter(model, seed):
    """A drafter whose logits are the LLM's own at the root's state (zero residual blocks, the
    LM head on the hidden half): it drafts the root token again, which a tiny random LLM's
    greedy loops accept often enough to exercise acceptance."""
    drafter = tiny_drafter(128, 64, seed=seed, rnn=False)
    for block in drafter.lm_head[:-1]:
        block.linear.weight = mx.zeros_like(block.linear.weight)
        block.linear.bias = mx.zeros_like(block.linear.bias)
    head = model.lm_head.weight if "lm_head" in model else model.model.embed_tokens.weight
    drafter.lm_head[-1].weight = mx.concatenate([head, mx.zeros_like(head)], axis=1)
    mx.eval(drafter.parameters())
    return drafter


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("lookup", [0, 2])
def test_engine_with_int8_drafts_equals_mlx_lm(family, lookup):
    model = tiny_llm(family, vocab_size=64, hidden_size=128, seed=3)
    llm = TreeLLM(model)
    rng = np.random.default_rng(lookup)
    accepted = 0
    for _ in range(3):
        prompt = rng.integers(0, 64, int(rng.integers(2, 12))).tolist()
        want = [t for o in stream_autoregressive(model, prompt, max_tokens=40) for t in o.tokens]
        drafter = repeating_drafter(model, seed=int(rng.integers(0, 100)))
        propose = make_proposer(drafter, llm.embed, 1, 3, int8=True)
        assert isinstance(propose, Int8OneBeam)
        outs = list(stream_redrafter(llm, propose, prompt, max_tokens=40, lookup=lookup))
        assert [t for o in outs for t in o.tokens] == want
        accepted += sum(o.stats.accepted for o in outs)
    assert accepted > 0  # drafts were accepted: the test exercises them


def test_a_float16_drafter_stays_float16_where_it_drafts_from_int8_copies(monkeypatch):
    """Drafter.from_pretrained keeps a shipped drafter's float16 (as does load with
    cast_drafter=False). Beside a float32 LLM, stream_generate drafts one beam from int8 copies
    of it as it is (the same copies its float32 cast gives), so it stays float16: half the
    resident bytes. A float beam search (W=2) casts it, since the CPU runs float16 products
    several times slower. Same tokens as mlx-lm either way."""
    model = tiny_llm("qwen2", vocab_size=64, hidden_size=128, seed=3)
    drafter = repeating_drafter(model, seed=5)
    drafter.set_dtype(mx.float16)
    built = []
    real = Int8OneBeam.for_drafter.__func__

    def spy(cls, *a, **kw):
        built.append(real(cls, *a, **kw))
        return built[-1]

    monkeypatch.setattr(Int8OneBeam, "for_drafter", classmethod(spy))
    prompt = [3, 9, 27, 17, 51]
    want = [t for o in stream_autoregressive(model, prompt, max_tokens=24) for t in o.tokens]
    outs = stream_generate(model, drafter, prompt, beam_width=1, beam_length=3, max_tokens=24)
    assert [t for o in outs for t in o.tokens] == want
    assert drafter.dtype == mx.float16
    assert built and isinstance(built[0], Int8OneBeam)
    outs = stream_generate(model, drafter, prompt, beam_width=2, beam_length=3, max_tokens=24)
    assert [t for o in outs for t in o.tokens] == want
    assert drafter.dtype == mx.float32
    scored = repeating_drafter(model, seed=6)
    scored.set_dtype(mx.float16)
    assert len(step_cost(model, scored, 1, 3)) == 3  # the --prune calibration: a float search
    assert scored.dtype == mx.float32
