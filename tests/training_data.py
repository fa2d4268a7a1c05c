"""A tiny, deterministic training set-up shared by the training tests and the worker."""

from redrafter_mlx.training import Example, TrainConfig, new_drafter

import mlx.core as mx
import numpy as np


def tiny_setup(steps: int = 4, batch_rows: int = 8, grad_accum: int = 1):
    rng = np.random.default_rng(0)
    V, H = 40, 16
    table = mx.array(rng.normal(size=(V, H)).astype(np.float32))
    examples = []
    for n in rng.integers(5, 30, size=12):
        base = rng.integers(0, V, size=4)
        tokens = np.resize(base, n).astype(np.int32)  # periodic: learnable
        examples.append(Example(tokens, rng.normal(size=(n, H)).astype(np.float32)))
    cfg = TrainConfig(
        horizons=3,
        window=8,
        batch_rows=batch_rows,
        grad_accum=grad_accum,
        steps=steps,
        warmup=2,
        lr=1e-2,
        log_every=1,
        checkpoint_every=2,
    )
    drafter = new_drafter(cfg, H, V, draft_vocab=list(range(0, V, 2)))
    return drafter, (lambda t: table[t]), examples, cfg
