"""The real demo model (Qwen2.5-Coder-0.5B-Instruct, converted from its PyPI-shipped GGUF).

Skipped, with the reason, where the converted model is not on this machine. Point
``REDRAFTER_DEMO_MODEL`` at a converted folder to use another location.
"""

import os
from pathlib import Path

import redrafter_mlx.paths
from redrafter_mlx.drafter import Drafter, DrafterConfig
from redrafter_mlx.generate import stream_autoregressive, stream_generate, stream_redrafter
from redrafter_mlx.llm import TreeLLM
from redrafter_mlx.loading import load, model_dims
from redrafter_mlx.oracle import OracleProposer

import mlx.core as mx
import pytest

DEMO = Path(
    os.environ.get(
        "REDRAFTER_DEMO_MODEL",
        redrafter_mlx.paths.models_dir() / "qwen2.5-coder-0.5b-instruct",
    )
)
PROMPT = 'def is_palindrome(s: str) -> bool:\n    """True if s reads the same backwards."""\n'

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        not (DEMO / "config.json").is_file(),
        reason=f"demo model not converted at {DEMO} (set REDRAFTER_DEMO_MODEL or convert it)",
    ),
]


@pytest.fixture(scope="module")
def demo():
    model, tokenizer, _ = load(DEMO)
    ids = tokenizer.encode(PROMPT)
    ref = [t for o in stream_autoregressive(model, ids, max_tokens=32) for t in o.tokens]
    return model, tokenizer, ids, ref


def test_greedy_32_tokens_equal_mlx_lm_with_random_drafter(demo):
    model, tokenizer, ids, ref = demo
    hidden, vocab = model_dims(model)
    mx.random.seed(0)
    drafter = Drafter(
        DrafterConfig(vocab_size=vocab, hidden_size=hidden, draft_vocab=list(range(4096)))
    )
    outs = list(stream_generate(model, drafter, ids, beam_width=4, beam_length=5, max_tokens=32))
    assert [t for o in outs for t in o.tokens] == ref
    assert "return" in tokenizer.decode(ref) or "==" in tokenizer.decode(ref)


def test_greedy_32_tokens_equal_mlx_lm_with_oracle_drafts(demo):
    model, _, ids, ref = demo
    llm = TreeLLM(model)
    propose = OracleProposer(llm, ids, ref, 4, 5, model_dims(model)[1])
    outs = list(stream_redrafter(llm, propose, ids, max_tokens=32))
    assert [t for o in outs for t in o.tokens] == ref
    assert outs[-1].summary.tokens_per_step >= 4.0
