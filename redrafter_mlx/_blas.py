"""Give MLX's CPU backend a fast BLAS on Linux: Intel MKL when installed, else OpenBLAS.

The ``mlx-cpu`` wheel links the reference (netlib) BLAS, whose float32 GEMM runs at about
2 GFLOP/s. Multi-token verification then costs about k times a single token and speculative
decoding cannot win. Loading a BLAS with global symbol scope *before* ``mlx.core`` is
imported makes MLX's ``cblas_*`` calls resolve to it.

Which one (measured on a 2-core Xeon, Qwen2.5-0.5B float32, one forward of n new tokens):

- OpenBLAS (Debian's 0.3.21, ``apt install libopenblas0-pthread``): 180 ms for n=1, 242 ms
  for n=4; its single-row GEMM runs well below memory bandwidth (the 151936x896 LM head:
  52 ms, 2.6 GB read at ~10 GB/s).
- MKL (``pip install "redrafter-mlx[mkl]"``): 86 ms for n=1 (the LM head 18 ms), 105 ms for
  n=3, but 189 ms for n=4 (its kernels for four or more rows re-read the weights).

``REDRAFTER_BLAS`` picks: ``auto`` (default: MKL when its wheel is installed, else
OpenBLAS), ``mkl`` or ``openblas``. ``REDRAFTER_OPENBLAS=/path/to/libopenblas.so`` names an
OpenBLAS file; ``REDRAFTER_NO_OPENBLAS=1`` loads nothing. This module must not import mlx. It
is a no-op on macOS (MLX uses Accelerate/Metal there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

_CANDIDATES = ("libopenblas.so.0", "libopenblas.so", "libopenblasp-r0.so")
_INSTALL_HINT = "sudo apt install libopenblas0-pthread"
# The layers of MKL's "intel_lp64 + intel_thread + core + iomp5" link line, dependencies first.
_MKL_LAYERS = ("libiomp5.so", "libmkl_core.so", "libmkl_intel_thread.so", "libmkl_intel_lp64.so")

#: What happened: "loaded:<path>" (OpenBLAS), "loaded:mkl:<folder>", "missing", "too-late",
#: "skipped" or "not-linux".
status: str = "not-run"


def _warn(message: str) -> None:
    print(f"redrafter-mlx: {message}", file=sys.stderr)


def mkl_folder() -> Path | None:
    """The folder holding the ``mkl`` wheel's shared libraries, or None if not installed."""
    from importlib import metadata

    try:
        files = metadata.files("mkl") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmkl_core.so"):
            return Path(f.locate()).resolve().parent
    return None


def _dlopen_global(path: Path) -> str | None:
    """dlopen with RTLD_LAZY | RTLD_GLOBAL; the error text, or None on success.

    ctypes.CDLL always adds RTLD_NOW, which MKL's layers cannot satisfy one at a time
    (core and the threading layer call into each other), so libc's dlopen is called directly.
    """
    libc = ctypes.CDLL(None)
    libc.dlopen.restype = ctypes.c_void_p
    libc.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.dlerror.restype = ctypes.c_char_p
    if libc.dlopen(str(path).encode(), os.RTLD_LAZY | os.RTLD_GLOBAL):
        return None
    return (libc.dlerror() or b"unknown error").decode(errors="replace")


def _load_mkl(folder: Path) -> str | None:
    """Load MKL's layers from ``folder``; None on success, else what went wrong."""
    for layer in _MKL_LAYERS:
        found = sorted(folder.glob(layer + "*"), key=lambda p: len(p.name))
        if not found:
            return f"{layer} is not in {folder}"
        error = _dlopen_global(found[0])
        if error:
            return error
    return None


def _load_openblas(explicit: str | None) -> str | None:
    """Load OpenBLAS (the ``explicit`` file, else the usual names); the name loaded, or None."""
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
        return name
    return None


def load_blas() -> str:
    """Load MKL or OpenBLAS globally if possible; say once on stderr when it cannot be done."""
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
            "mlx was imported before redrafter_mlx, so a fast BLAS could not be loaded first; "
            "matrix products use MLX's slow reference BLAS. Import redrafter_mlx before mlx "
            "(or run with LD_PRELOAD=libopenblas.so.0)."
        )
        return status
    explicit = os.environ.get("REDRAFTER_OPENBLAS")
    choice = os.environ.get("REDRAFTER_BLAS", "auto").lower()
    if choice not in ("auto", "mkl", "openblas"):
        _warn(f"REDRAFTER_BLAS={choice!r} is not one of auto, mkl, openblas; using auto")
        choice = "auto"
    if choice in ("auto", "mkl") and not explicit:
        folder = mkl_folder()
        if folder is not None:
            error = _load_mkl(folder)
            if error is None:
                status = f"loaded:mkl:{folder}"
                return status
            _warn(f"MKL is installed but could not be loaded ({error}); trying OpenBLAS")
        elif choice == "mkl":
            _warn("REDRAFTER_BLAS=mkl but MKL is not installed (pip install mkl); trying OpenBLAS")
    name = _load_openblas(explicit)
    if name is not None:
        status = f"loaded:{name}"
        return status
    status = "missing"
    where = f" at REDRAFTER_OPENBLAS={explicit}" if explicit else ""
    _warn(
        f"OpenBLAS not found{where}; MLX on Linux falls back to its reference BLAS, about 10x "
        "slower for matrix products, and speculative decoding cannot win. "
        f"Install it: {_INSTALL_HINT} (or pip install mkl)"
    )
    return status
