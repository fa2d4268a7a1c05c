"""What each decoder's peak memory counts: its own weights and allocations, nothing else."""

from redrafter_mlx.generate import parameter_bytes, stream_autoregressive, stream_generate

import mlx.core as mx
from tiny_models import tiny_drafter, tiny_llm

PROMPT = list(range(1, 12))


def ar_peak(model) -> float:
    return list(stream_autoregressive(model, PROMPT, max_tokens=8))[-1].summary.peak_memory_gb


def test_ar_peak_leaves_out_arrays_mlx_lm_never_holds():
    """A bench loads the drafter beside the LLM; mlx-lm's decoding alone would not hold it,
    so its weights (here a 16 MB stand-in) must not raise the baseline's peak."""
    model = tiny_llm("llama")
    alone = ar_peak(model)
    other = mx.zeros((4_000_000,), mx.float32)
    mx.eval(other)
    assert abs(ar_peak(model) - alone) < 1e-3  # GB: the 16 MB array is left out
    assert alone * 1e9 >= parameter_bytes(model)  # the LLM's own weights are in it


def test_redrafter_peak_holds_the_llm_and_the_drafter():
    model, drafter = tiny_llm("llama"), tiny_drafter()
    steps = list(stream_generate(model, drafter, PROMPT, beam_width=2, beam_length=3, max_tokens=8))
    peak = steps[-1].summary.peak_memory_gb * 1e9
    assert peak >= parameter_bytes(model) + parameter_bytes(drafter)
