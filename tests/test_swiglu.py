"""mlx-lm's swiglu on the host (redrafter_mlx/swiglu.py): bit-identical to MLX's, and only
inside our forwards."""

import redrafter_mlx  # noqa: F401  (first: loads the kernel and the BLAS)
from redrafter_mlx import _blas, swiglu
from redrafter_mlx.beam_search import make_proposer
from redrafter_mlx.generate import stream_autoregressive, stream_redrafter
from redrafter_mlx.llm import TreeLLM

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from tiny_models import tiny_drafter, tiny_llm

pytestmark = pytest.mark.skipif(
    not swiglu.usable(), reason="the vectorised swiglu does not run here (no AVX2/FMA kernel)"
)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 70), elements=st.floats(width=32)),
    st.integers(0, 2**31 - 1),
)
def test_host_swiglu_equals_mlx_bit_for_bit(g, seed):
    # Any float32 gate, NaN and infinities included; lengths that leave a tail of 1-7 floats.
    u = np.random.default_rng(seed).standard_normal(g.size).astype(np.float32)
    ours = _blas.swiglu(g, u)
    assert same_bits(ours, np.array(mlx_lm_swiglu(mx.array(g), mx.array(u))))


def test_host_swiglu_on_every_scale_and_the_clamps():
    rng = np.random.default_rng(1)
    g = np.concatenate(
        [
            np.float32(10.0) ** rng.uniform(-40, 5, 200_000).astype(np.float32),
            rng.uniform(-90, 90, 200_000),
            np.nextafter(np.float32([88, -88, 0.5, -0.5]), np.float32(0)),
        ]
    ).astype(np.float32)
    g[::2] *= -1
    u = rng.standard_normal(g.size).astype(np.float32)
    assert same_bits(_blas.swiglu(g, u), np.array(mlx_lm_swiglu(mx.array(g), mx.array(u))))
    # The MLX-facing wrapper, on a [1, n, d] activation.
    x, up = mx.array(g.reshape(1, -1, 4)), mx.array(u.reshape(1, -1, 4))
    assert same_bits(np.array(swiglu.host_swiglu(x, up)), np.array(mlx_lm_swiglu(x, up)))


def test_host_swiglu_rounds_exp_like_mlx_next_to_half_integers():
    # MLX's exp rounds x = |g| * log2(e) to an integer as floor(x + 0.5), in double: gates a
    # few ulps around every k + 0.5 exercise that rounding and the exponent's steps.
    g0 = (np.arange(0, 128) + 0.5) / np.float32(1.442695)
    bits = g0.astype(np.float32).view(np.int32)[:, None] + np.arange(-16, 17)[None]
    g = bits.astype(np.int32).view(np.float32).ravel()
    g = np.concatenate([g, -g])
    u = np.ones_like(g)
    assert same_bits(_blas.swiglu(g, u), np.array(mlx_lm_swiglu(mx.array(g), mx.array(u))))


def test_host_swiglu_declines_what_it_does_not_compute():
    g = mx.ones((2, 8))
    assert swiglu.host_swiglu(g.astype(mx.float16), g.astype(mx.float16)) is None
    assert swiglu.host_swiglu(g, mx.ones((1, 8))) is None  # broadcasting: MLX's own


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_swiglu_runs_on_the_host_only_inside_our_forwards(family, monkeypatch):
    calls = []
    original = swiglu.host_swiglu

    def counted(gate, x):
        calls.append(gate.shape)
        return original(gate, x)

    monkeypatch.setattr("redrafter_mlx.llm.host_swiglu", counted)
    model = tiny_llm(family)
    llm = TreeLLM(model)
    prompt = [1, 5, 9, 2, 7]
    ar = [s.tokens for s in stream_autoregressive(model, prompt, max_tokens=12)]
    assert calls == []  # mlx-lm's own decoding keeps MLX's swiglu
    propose = make_proposer(tiny_drafter(), llm.embed, 2, 3)
    steps = list(stream_redrafter(llm, propose, prompt, max_tokens=12))
    assert len(calls) >= len(model.layers) * len(steps)  # every layer of every forward
    assert [t for s in steps for t in s.tokens] == [t for s in ar for t in s]
