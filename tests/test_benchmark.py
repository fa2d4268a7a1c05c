"""The benchmark helpers that decide what a bench/ script's numbers mean."""

from redrafter_mlx.benchmark import alternating_rounds


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
