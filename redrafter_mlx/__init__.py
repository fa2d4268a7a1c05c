"""redrafter-mlx: Recurrent Drafter speculative decoding on MLX.

The paper's three ideas live in three modules:

- :mod:`redrafter_mlx.drafter` and :mod:`redrafter_mlx.beam_search`: the recurrent drafter and
  the beam search that proposes several continuations;
- :mod:`redrafter_mlx.tree_attention`: dynamic tree attention, packing the beams into a prefix
  tree verified in one LLM forward;
- :mod:`redrafter_mlx.verification`: lossless acceptance (greedy and exact sampling).

:mod:`redrafter_mlx.generate` runs them in a loop over an mlx-lm model.
"""

from ._blas import load_blas

load_blas()  # must run before anything imports mlx.core

__version__ = "0.1.0"
