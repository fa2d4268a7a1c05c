"""One-beam drafting from int8 copies of the drafter's weights, where the few-row kernel runs.

At W=1, beam search is a chain of argmaxes, and on the CPU each drafter step costs the bytes of
float32 weights it streams: the demo drafter reads 76 MB per drafted token (two steps at L=3:
5.6 ms on the 2-core AMD machine), about 7% of a step. This proposer keeps an int8 copy of
each matrix (one scale per row, a quarter of the bytes) and computes every product with the
LM head screen's integer arithmetic (:func:`redrafter_mlx._blas.head_screen`: activations
rounded to int16 with one scale per row, sums exact in int32), the rest in NumPy.

Its drafts are approximate: where two of the drafter's logits nearly tie, the rounding may pick
the other. That changes what gets verified, never the output: greedy keeps mlx-lm's tokens and
sampling the LLM's law, since a draft never depends on the step's own draws.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import _blas
from .drafter import Drafter

#: Weight dtypes that widen to float32 exactly.
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class Int8Linear:
    """``x @ W.T + b`` with W in int8 (one scale per row) and x rounded to int16 per row."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, bias: np.ndarray | None):
        self.q, self.scale, self.bias = q, scale, bias  # [N, K] int8, [N], [N] or None

    @classmethod
    def from_linear(cls, layer: nn.Module) -> Int8Linear | None:
        """From a floating-point ``nn.Linear`` the kernel computes here; None otherwise.

        The copy is taken from the weights in float32, which float16 and bfloat16 widen to
        exactly: a shipped float16 drafter gives the very copy its float32 cast would, so it
        need not be cast (and kept resident at twice the bytes) to draft this way."""
        if type(layer) is not nn.Linear or layer.weight.dtype not in FLOAT_DTYPES:
            return None
        n, k = layer.weight.shape
        if not _blas.kernel_takes(1, n, k):
            return None
        weight = np.array(layer.weight.astype(mx.float32))
        quantized = _blas.head_quantize(np.ascontiguousarray(weight))
        if quantized is None:  # a non-finite weight
            return None
        bias = np.array(layer.bias.astype(mx.float32)) if "bias" in layer else None
        return cls(quantized[0], quantized[1], bias)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x: [M, K] float32 -> [M, N] float32."""
        x16, x_scale = _blas.int16_rows(x)  # non-finite x: a wasted draft, nothing worse
        y = _blas.head_screen(np.ascontiguousarray(x16), x_scale, self.q, self.scale)
        return y if self.bias is None else y + self.bias


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


class Int8OneBeam:
    """A :data:`~redrafter_mlx.beam_search.Proposer` for one beam of ``length`` tokens: the
    drafter's argmax chain (what beam search gives at W=1) with int8 products."""

    def __init__(
        self,
        drafter: Drafter,
        embed: Callable[[mx.array], mx.array],
        length: int,
        layers: dict[str, Int8Linear],
    ):
        self.embed, self.length, self.layers = embed, length, layers
        vocab = drafter.config.draft_vocab
        self.vocab = np.array(vocab, dtype=np.int32) if vocab is not None else None
        self.blocks = [layers[f"lm_head.{i}"] for i in range(drafter.config.num_draft_layers)]
        self.out = layers[f"lm_head.{drafter.config.num_draft_layers}"]

    @classmethod
    def for_drafter(
        cls, drafter: Drafter, embed: Callable[[mx.array], mx.array], length: int
    ) -> Int8OneBeam | None:
        """None where any of the drafter's products would not run in the kernel here (not
        Linux x86-64, quantized weights, a dimension below the kernel's minimum)."""
        if length < 2:
            raise ValueError(f"a beam holds the root and >= 1 drafted token, got length {length}")
        n = drafter.config.num_draft_layers
        modules = {f"lm_head.{i}": drafter.lm_head[i].linear for i in range(n)}
        modules[f"lm_head.{n}"] = drafter.lm_head[n]
        modules.update(
            {k: getattr(drafter, k) for k in ("input_proj", "rnn_w", "rnn_u") if k in drafter}
        )
        layers = {}
        for name, module in modules.items():
            layer = Int8Linear.from_linear(module)
            if layer is None:
                return None
            layers[name] = layer
        return cls(drafter, embed, length, layers)

    @property
    def nbytes(self) -> int:
        """Host memory of the int8 copies (not in MLX's peak-memory count)."""
        return sum(
            q.q.nbytes + q.scale.nbytes + (0 if q.bias is None else q.bias.nbytes)
            for q in self.layers.values()
        )

    def _embedding(self, token: int) -> np.ndarray:
        return np.array(self.embed(mx.array([token])).astype(mx.float32))  # [1, H]

    def __call__(self, hidden: mx.array, g0: mx.array) -> mx.array:
        """hidden: [H], the LLM state that produced g0; g0: [] the root. Returns [1, length]."""
        h = np.array(hidden.astype(mx.float32)).reshape(1, -1)
        tokens = [int(g0.item())]
        state = np.zeros_like(h)
        layers = self.layers
        for _ in range(self.length - 1):
            e = self._embedding(tokens[-1])
            if "rnn_w" in layers:
                state = _silu(layers["rnn_w"](e) + layers["rnn_u"](state))
            else:
                state = state + e
            x = np.concatenate([h, state], axis=1)
            if "input_proj" in layers:
                x = layers["input_proj"](x)
            for block in self.blocks:
                x = x + _silu(block(x))
            j = int(np.argmax(self.out(x)[0]))
            tokens.append(int(self.vocab[j]) if self.vocab is not None else j)
        return mx.array([tokens], dtype=mx.int32)
