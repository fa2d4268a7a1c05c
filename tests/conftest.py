"""Shared test set-up.

``redrafter_mlx`` is imported before anything imports ``mlx.core``: on Linux its ``__init__``
loads a fast BLAS (MKL or OpenBLAS) first (see ``redrafter_mlx/_blas.py``), which makes the
tests ~10x faster.
"""

import redrafter_mlx  # noqa: F401  (must precede every mlx import)
