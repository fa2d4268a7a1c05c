"""The Linux BLAS loader: MKL or OpenBLAS loaded when present, one clear stderr line when not."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_openblas_loaded_before_mlx():
    r = run(
        "import redrafter_mlx, redrafter_mlx._blas as b, sys;"
        "print(b.status); print('mlx.core' in sys.modules)",
        REDRAFTER_BLAS="openblas",
    )
    status, _ = r.stdout.split()
    if status == "missing":
        pytest.skip("libopenblas is not installed here (apt install libopenblas0-pthread)")
    assert status.startswith("loaded:"), r.stdout + r.stderr
    assert r.stderr == ""
    maps = run(
        "import redrafter_mlx, mlx.core as mx; print(open('/proc/self/maps').read())",
        REDRAFTER_BLAS="openblas",
    )
    assert "libopenblas" in maps.stdout and "libmkl" not in maps.stdout


def test_missing_openblas_says_so_once():
    r = run(
        "import redrafter_mlx._blas as b; print(b.status); print(b.load_blas())",
        REDRAFTER_OPENBLAS="/nonexistent/libopenblas.so.0",
    )
    assert r.stdout.split() == ["missing", "missing"]
    assert r.stderr.count("OpenBLAS not found") == 1
    assert "apt install libopenblas0-pthread" in r.stderr


def test_mlx_imported_first_is_reported():
    r = run("import mlx.core; import redrafter_mlx, redrafter_mlx._blas as b; print(b.status)")
    assert r.stdout.strip() == "too-late"
    assert "imported before redrafter_mlx" in r.stderr


def test_opt_out():
    r = run("import redrafter_mlx._blas as b; print(b.status)", REDRAFTER_NO_OPENBLAS="1")
    assert r.stdout.strip() == "skipped" and r.stderr == ""


# 64 rows: more than the few-row kernel takes (see test_skinny_gemm.py), so the BLAS computes it.
MATMUL = (
    "import redrafter_mlx, redrafter_mlx._blas as b, numpy as np, mlx.core as mx;"
    "a = np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32);"
    "w = np.random.default_rng(1).standard_normal((96, 64), dtype=np.float32);"
    "y = np.array(mx.array(a) @ mx.array(w).T);"
    "print(b.status); print(float(np.abs(y - a @ w.T).max()))"
)


def test_mkl_is_what_mlx_calls_when_installed():
    """With the mkl wheel installed, auto picks it and MLX's matmul goes through MKL's SGEMM
    (MKL_VERBOSE logs every call it serves) with the right answer."""
    from redrafter_mlx._blas import mkl_folder

    if mkl_folder() is None:
        pytest.skip("the mkl wheel is not installed (pip install mkl)")
    r = run(MATMUL, MKL_VERBOSE="1", REDRAFTER_BLAS="auto")
    lines = r.stdout.splitlines()
    status, err = [line for line in lines if not line.startswith("MKL_VERBOSE")]
    assert status.startswith("loaded:mkl:"), r.stdout + r.stderr
    assert float(err) < 1e-4
    assert any(line.startswith("MKL_VERBOSE SGEMM") for line in lines), r.stdout
    assert "redrafter-mlx:" not in r.stderr
    # And REDRAFTER_BLAS=openblas keeps MKL out of the process.
    r = run(MATMUL, MKL_VERBOSE="1", REDRAFTER_BLAS="openblas")
    assert "MKL_VERBOSE" not in r.stdout and r.stdout.split()[0].startswith("loaded:"), r.stdout


def test_mkl_requested_but_not_installed_says_so():
    r = run(
        "import os, redrafter_mlx._blas as b;"  # imported with everything skipped, then re-run
        "del os.environ['REDRAFTER_NO_OPENBLAS']; os.environ['REDRAFTER_BLAS'] = 'mkl';"
        "b.status = 'not-run'; b.mkl_folder = lambda: None; print(b.load_blas())",
        REDRAFTER_NO_OPENBLAS="1",
    )
    assert r.stderr.count("REDRAFTER_BLAS=mkl but MKL is not installed (pip install mkl)") == 1
    assert r.stdout.strip() == "missing" or "libopenblas" in r.stdout, r.stdout + r.stderr


def test_unknown_blas_choice_is_named():
    r = run("import redrafter_mlx._blas as b; print(b.status)", REDRAFTER_BLAS="fastest")
    assert "REDRAFTER_BLAS='fastest' is not one of auto, mkl, openblas" in r.stderr
    assert r.stdout.strip().startswith("loaded:") or r.stdout.strip() == "missing"
