"""The benchmark helpers that decide what a bench/ script's numbers mean."""

from redrafter_mlx.benchmark import alternating_rounds, chain_hidden, timed_on_cache
from redrafter_mlx.generate import prefill
from redrafter_mlx.llm import TreeLLM

import mlx.core as mx
from tiny_models import tiny_llm


def test_alternating_rounds_interleaves_calls_and_drops_the_warm_up():
    order = []

    def call(name):
        def run():
            order.append(name)
            return 100.0 if order.count(name) == 1 else float(len(order))

        return run

    times = alternating_rounds({"a": call("a"), "b": call("b")}, rounds=3)
    # every call once per round, in turn: the machine's drift hits them alike
    assert order == ["a", "b"] * 4
    # round 0 (the 100.0 each call returns first) is a warm-up and is not kept
    assert times == {"a": [3.0, 5.0, 7.0], "b": [4.0, 6.0, 8.0]}


def test_timed_on_cache_trims_the_forward_back_off():
    """Every timed forward must see the same context: the n tokens it added are trimmed."""
    llm = TreeLLM(tiny_llm("llama"))
    cache = llm.make_cache()
    mx.eval(prefill(llm, cache, list(range(1, 10))))
    past = cache[0].length

    def forward() -> mx.array:
        hidden = chain_hidden(llm, cache, past, 3)
        mx.eval(hidden)
        return hidden

    runs = [timed_on_cache(cache, 3, forward) for _ in range(3)]
    assert cache[0].length == past
    for dt, hidden in runs:
        assert dt > 0 and hidden.shape[0] == 3
        assert mx.array_equal(hidden, runs[0][1])  # the same context every time
