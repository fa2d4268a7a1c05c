"""The Linux OpenBLAS loader: loaded when present, one clear stderr line when not."""

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
        "print(b.status); print('mlx.core' in sys.modules)"
    )
    status, _ = r.stdout.split()
    if status == "missing":
        pytest.skip("libopenblas is not installed here (apt install libopenblas0-pthread)")
    assert status.startswith("loaded:"), r.stdout + r.stderr
    assert r.stderr == ""
    maps = run("import redrafter_mlx, mlx.core as mx; print(open('/proc/self/maps').read())")
    assert "libopenblas" in maps.stdout


def test_missing_openblas_says_so_once():
    r = run(
        "import redrafter_mlx._blas as b; print(b.status); print(b.load_openblas())",
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
