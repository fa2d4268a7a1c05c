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

Neither streams the weights once for a few rows, which is what decoding and tree verification
multiply, so the few-row kernel (``_skinny_gemm.c``, built with the package) is loaded first and
takes the products with at most ``REDRAFTER_GEMM_ROWS`` (default 32; 0 turns it off) rows;
everything else (long prompt chunks, training, attention) goes to the BLAS, small products to
MKL on one thread (its OpenMP workers spin between calls and took the kernel's cores: a 3-token
forward took 123 ms against 101 ms). Measured on a 2-core AMD EPYC
with MKL, one forward of Qwen2.5-0.5B over n tokens: n = 1 / 3 / 8 took 124 / 284 / 250 ms
with MKL alone and 89 / 112 / 151 ms with the kernel in front of it; n = 32 460 and 377 ms;
n = 64 765 and 751 ms (so the default stops at 32).

``REDRAFTER_BLAS`` picks: ``auto`` (default: MKL when its wheel is installed, else
OpenBLAS), ``mkl`` or ``openblas``. ``REDRAFTER_OPENBLAS=/path/to/libopenblas.so`` names an
OpenBLAS file; ``REDRAFTER_NO_OPENBLAS=1`` loads nothing (neither BLAS nor kernel);
``REDRAFTER_GEMM_THREADS`` sets the kernel's threads (default: one per core, at most 8) and
``REDRAFTER_GEMM_PREFETCH`` how far ahead (floats) it prefetches each weight stream (default
512; 0: off; :func:`gemm_prefetch` changes it in a running process). This
module must not import mlx. It is a no-op on macOS (MLX uses Accelerate/Metal there).
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
#: The few-row kernel: "on", "off" (REDRAFTER_GEMM_ROWS=0), "not-built", "unsupported-cpu",
#: or "not-run" (not Linux, nothing loaded, or mlx imported first).
gemm: str = "not-run"
_gemm_lib: ctypes.CDLL | None = None


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


def summary() -> str:
    """What computes MLX's matrix products here, in one string (benchmarks print it; stored
    tunes compare it, so a kernel with another cost curve invalidates them)."""
    if gemm == "not-run":
        return status
    version = getattr(_gemm_lib, "redrafter_gemm_version", None)
    return f"{status}; few-row gemm {gemm}" + (f" v{version()}" if gemm == "on" and version else "")


def _gemm_library() -> Path | None:
    """The built few-row kernel (``redrafter_mlx/_skinny_gemm*.so``), or None."""
    import importlib.util

    spec = importlib.util.find_spec("redrafter_mlx._skinny_gemm")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _load_gemm() -> None:
    """Load the few-row kernel with global scope, before any BLAS, so its cblas_sgemm is the
    one MLX binds; it passes what it does not compute to the BLAS loaded after it."""
    global gemm, _gemm_lib
    path = _gemm_library()
    if path is None:
        gemm = "not-built"
        _warn(
            "the few-row GEMM kernel was not built (it needs a C compiler at install time: "
            "pip install -e . with gcc); decoding uses the BLAS alone, and more slowly"
        )
        return
    try:
        _gemm_lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        gemm = "not-built"
        _warn(f"the few-row GEMM kernel {path} could not be loaded ({e}); using the BLAS alone")
        return
    _gemm_lib.redrafter_gemm_init.argtypes = [ctypes.c_int, ctypes.c_int]
    _gemm_lib.redrafter_gemm_handled.restype = ctypes.c_long
    _gemm_lib.redrafter_gemm_serial.restype = ctypes.c_long
    _gemm_lib.redrafter_gemm_takes.argtypes = [ctypes.c_int] * 3
    ptr = ctypes.c_void_p
    _gemm_lib.redrafter_head_screen.argtypes = [ctypes.c_int] * 3 + [ptr] * 5
    _gemm_lib.redrafter_head_screen.restype = None
    _gemm_lib.redrafter_head_exact.argtypes = [ctypes.c_int] * 2 + [ptr] * 3 + [ctypes.c_int, ptr]
    _gemm_lib.redrafter_head_exact.restype = None
    _gemm_lib.redrafter_head_quantize.argtypes = [ctypes.c_int] * 2 + [ptr] * 4
    _gemm_lib.redrafter_screen_tail.argtypes = [ctypes.c_long, ptr, ptr, ctypes.c_float, ptr]
    _gemm_lib.redrafter_screen_tail.argtypes += [ctypes.c_long, ptr]
    _gemm_lib.redrafter_screen_tail.restype = ctypes.c_long
    _gemm_lib.redrafter_gemm_prefetch.argtypes = [ctypes.c_long]
    _gemm_lib.redrafter_gemm_prefetch.restype = ctypes.c_long
    _gemm_lib.redrafter_swiglu.argtypes = [ctypes.c_long, ptr, ptr, ptr]
    _gemm_lib.redrafter_swiglu.restype = ctypes.c_int


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        _warn(f"{name}={value!r} is not an integer; using {default}")
        return default


def _start_gemm() -> None:
    """Turn the loaded kernel on (after the BLAS is loaded)."""
    global gemm
    if _gemm_lib is None:
        return
    rows = _env_int("REDRAFTER_GEMM_ROWS", 32)
    threads = _env_int("REDRAFTER_GEMM_THREADS", 0)
    gemm_prefetch(_env_int("REDRAFTER_GEMM_PREFETCH", gemm_prefetch()))  # default: the kernel's
    if rows <= 0:
        gemm = "off"
    elif _gemm_lib.redrafter_gemm_init(rows, threads):
        gemm = "on"
    else:
        gemm = "unsupported-cpu"


def handled_products() -> int:
    """Matrix products the few-row kernel has computed in this process (0 when it is off)."""
    if _gemm_lib is None:
        return 0
    return int(_gemm_lib.redrafter_gemm_handled())


def serial_products() -> int:
    """Small products the kernel passed to MKL on one thread in this process (see
    ``_skinny_gemm.c``: MKL's spinning OpenMP workers otherwise take cores from the kernel)."""
    if _gemm_lib is None:
        return 0
    return int(_gemm_lib.redrafter_gemm_serial())


def gemm_prefetch(floats: int | None = None) -> int | None:
    """The kernel's prefetch distance in floats (0: off), after setting it to ``floats`` when
    given; None where the kernel is not loaded. Results do not depend on it, only timings."""
    if _gemm_lib is None:
        return None
    return int(_gemm_lib.redrafter_gemm_prefetch(-1 if floats is None else max(0, floats)))


def gemm_rows_from_l2(on: bool | None = None) -> bool | None:
    """Whether 2-4 activation rows with a long dot product stream one weight row at a time
    with the activations in L2 (chosen on Zen 1) rather than in blocks of 4 weight rows, after
    setting it to ``on`` when given; None where the kernel is not loaded. Results do not
    depend on it, only timings."""
    if _gemm_lib is None:
        return None
    return bool(_gemm_lib.redrafter_gemm_rows_from_l2(-1 if on is None else int(on)))


def kernel_takes(rows: int, n: int, k: int) -> bool:
    """Whether a product of ``rows`` activation rows by an [n, k] weight's transpose runs in
    the few-row kernel here (not in the BLAS)."""
    return gemm == "on" and bool(_gemm_lib.redrafter_gemm_takes(rows, n, k))


def _ptr(a):  # a C-contiguous NumPy array's data pointer
    return a.ctypes.data


def int16_limit(k: int) -> int:
    """The largest ``|x16|`` :func:`head_screen` takes for dot products of length k: its int32
    sums of int16 x int8 products stay below 2^31."""
    return min(2**14 - 1, (2**31 - 1) // (127 * k))


def int16_rows(x):
    """x [M, K] (float32 or float64) rounded to int16 with one float32 scale per row, for
    :func:`head_screen`: (x16 [M, K] int16, scale [M]), x ~ scale * x16 and ``|x16| <=
    int16_limit(K)``; an all-zero row gets scale 1. Non-finite rows give meaningless values."""
    import numpy as np

    with np.errstate(invalid="ignore", divide="ignore"):
        scale = (np.abs(x).max(axis=1) / int16_limit(x.shape[1])).astype(np.float32)
        scale[scale == 0] = 1.0
        x16 = np.rint(x / scale[:, None]).astype(np.int16)
    return x16, scale


def head_screen(x16, x_scale, q, scale):
    """``(x16 @ q.T) * scale * x_scale[:, None]``, summed exactly in int32, on the kernel's threads.

    x16: [M, K] int16, x_scale: [M] float32, q: [N, K] int8, scale: [N] float32, all
    C-contiguous NumPy arrays, with ``max|x16| * 127 * K < 2**31``. Returns [M, N] float32."""
    import numpy as np

    (m, k), n = x16.shape, q.shape[0]
    out = np.empty((m, n), np.float32)
    lib = _gemm_lib
    lib.redrafter_head_screen(m, n, k, _ptr(x16), _ptr(x_scale), _ptr(q), _ptr(scale), _ptr(out))
    return out


def head_quantize(w):
    """The screen's int8 weights of w [N, K] (float32, C-contiguous): (q [N, K] int8, scale [N]
    float32, norms [N, 3] float64: ||w - scale q||, ||scale q||, ||w|| per row), or None if w
    has a non-finite value."""
    import numpy as np

    n, k = w.shape
    q, scale, norms = np.empty((n, k), np.int8), np.empty(n, np.float32), np.empty((n, 3))
    if _gemm_lib.redrafter_head_quantize(n, k, _ptr(w), _ptr(q), _ptr(scale), _ptr(norms)):
        return None
    return q, scale, norms


def head_exact(x, w, cols):
    """Columns ``cols`` of ``x @ w.T`` exactly as the kernel computes the whole product.

    x: [M, K] float32, w: [N, K] float32, cols: [n] int32, C-contiguous. Returns [M, n]."""
    import numpy as np

    m, k = x.shape
    out = np.empty((m, len(cols)), np.float32)
    _gemm_lib.redrafter_head_exact(m, k, _ptr(x), _ptr(w), _ptr(cols), len(cols), _ptr(out))
    return out


def screen_tail(s, eps, offset: float, max_cols: int):
    """One row's pass of the nucleus screen (``_skinny_gemm.c``): s, eps [V] float32, the
    screen's logits and their bounds. With ``best = max(s - eps)``: the columns whose ``s + eps``
    reaches ``best + offset`` (ascending, int32; None if more than ``max_cols``), and over the
    others ``(best, sum exp(s + eps - best), sum exp(s - eps - best), max(s + eps))``."""
    import numpy as np

    cols = np.empty(max_cols, np.int32)
    out = np.empty(4, np.float64)
    args = (_ptr(s), _ptr(eps), offset, _ptr(cols), max_cols, _ptr(out))
    n = _gemm_lib.redrafter_screen_tail(len(s), *args)
    return (cols[:n] if n <= max_cols else None), tuple(float(v) for v in out)


def swiglu(g, u):
    """``silu(g) * u`` with the operations MLX's CPU backend uses (see ``_skinny_gemm.c``), for
    C-contiguous float32 NumPy arrays of one shape; None where the kernel library is not
    loaded or the CPU lacks AVX2 and FMA."""
    import numpy as np

    if _gemm_lib is None:
        return None
    out = np.empty_like(g)
    return out if _gemm_lib.redrafter_swiglu(g.size, _ptr(g), _ptr(u), _ptr(out)) else None


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
    _load_gemm()
    try:
        return _load_a_blas()
    finally:
        _start_gemm()


def _load_a_blas() -> str:
    global status
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
