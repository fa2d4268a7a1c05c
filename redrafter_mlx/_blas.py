"""Make MLX's CPU backend use OpenBLAS on Linux.

The ``mlx-cpu`` wheel links the reference (netlib) BLAS, whose float32 GEMM runs at about
2 GFLOP/s. Multi-token verification then costs about k times a single token and speculative
decoding cannot win. Loading OpenBLAS with global symbol scope *before* ``mlx.core`` is
imported makes MLX's BLAS calls resolve to it (measured ~10x faster GEMM).

This module must not import mlx. It is a no-op on macOS (MLX uses Accelerate/Metal there).
Set ``REDRAFTER_OPENBLAS=/path/to/libopenblas.so`` to use a particular library, or
``REDRAFTER_NO_OPENBLAS=1`` to skip it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_CANDIDATES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp-r0.so")
_INSTALL_HINT = "sudo apt install libopenblas0-pthread"

#: What happened: "loaded:<path>", "missing", "too-late", "skipped" or "not-linux".
status: str = "not-run"


def _warn(message: str) -> None:
    print(f"redrafter-mlx: {message}", file=sys.stderr)


def load_openblas() -> str:
    """Load OpenBLAS globally if possible; say once on stderr when it cannot be done."""
    global status
    if status != "not-run":
        return status
    if not sys.platform.startswith("linux"):
        status = "not-linux"
        return status
    if os.environ.get("REDRAFTER_NO_OPENBLAS"):
        status = "skipped"
        return status
    if "mlx.core" in sys.modules:
        status = "too-late"
        _warn(
            "mlx was imported before redrafter_mlx, so OpenBLAS could not be loaded first; "
            "matrix products use MLX's slow reference BLAS. Import redrafter_mlx before mlx "
            "(or run with LD_PRELOAD=libopenblas.so.0)."
        )
        return status
    explicit = os.environ.get("REDRAFTER_OPENBLAS")
    if explicit:
        names = [explicit]
    else:
        names = list(_CANDIDATES)
        found = ctypes.util.find_library("openblas")
        if found:
            names.insert(0, found)
    for name in names:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        status = f"loaded:{name}"
        return status
    status = "missing"
    where = f" at REDRAFTER_OPENBLAS={explicit}" if explicit else ""
    _warn(
        f"OpenBLAS not found{where}; MLX on Linux falls back to its reference BLAS, about 10x "
        "slower for matrix products, and speculative decoding cannot win. "
        f"Install it: {_INSTALL_HINT}"
    )
    return status
