"""The few-row GEMM kernel in front of the BLAS (redrafter_mlx/_skinny_gemm.c, Linux only).

MLX's own matmul is the entry point throughout: what is tested is what the engine gets.
"""

import threading

import redrafter_mlx  # noqa: F401  (first: loads the kernel and the BLAS)
from redrafter_mlx import _blas

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_blas import run  # python -c in a fresh process

pytestmark = pytest.mark.skipif(
    _blas.gemm != "on", reason=f"the few-row GEMM kernel is not on here ({_blas.gemm})"
)


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


def close(got: mx.array, want: np.ndarray, k: int) -> None:
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5 * np.sqrt(k) * 4)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 40),  # up to 32 here, more goes to the BLAS
    n=st.integers(1, 300),
    k=st.integers(1, 300),  # the kernel takes k >= 128; every tail of 16 and 8
    transposed=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_products_match_a_float64_reference(m, n, k, transposed, bias, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n), dtype=np.float32)
    wt = w.T if transposed else w  # [k, n]
    c = rng.standard_normal(n, dtype=np.float32)
    aw = mx.array(w).T if transposed else mx.array(w)
    if bias:  # addmm: MLX passes beta = 1 with the bias already in the output
        got = mx.addmm(mx.array(c), mx.array(a), aw, alpha=0.5, beta=2.0)
        want = 0.5 * reference(a, wt) + 2.0 * c
    else:
        got = mx.array(a) @ aw
        want = reference(a, wt)
    close(got, want, k)


def test_the_weight_prefetch_changes_no_result():
    """Any distance, none, or one far past the weights (a prefetch never faults) gives the same
    bits, on the one-row-at-a-time path and the 4-row blocks (a long K)."""
    rng = np.random.default_rng(2)
    default = _blas.gemm_prefetch()
    try:
        for m, n, k in [(1, 4103, 896), (3, 4103, 903), (2, 901, 4864), (8, 517, 896)]:
            x = mx.array(rng.standard_normal((m, k), dtype=np.float32))
            w = mx.array(rng.standard_normal((n, k), dtype=np.float32))
            outs = []
            for floats in (0, 16, default, 1 << 20):
                assert _blas.gemm_prefetch(floats) == floats
                outs.append(np.array(x @ w.T))
            for out in outs[1:]:
                assert np.array_equal(out, outs[0]), (m, n, k)
            close(mx.array(outs[0]), reference(np.array(x), np.array(w).T), k)
    finally:
        _blas.gemm_prefetch(default)
    assert _blas.gemm_prefetch() == default == 512


def test_the_prefetch_distance_comes_from_the_environment():
    r = run(
        "import redrafter_mlx, redrafter_mlx._blas as b; print(b.gemm_prefetch())",
        REDRAFTER_GEMM_PREFETCH="0",
    )
    assert r.stdout.strip() == "0", r.stdout + r.stderr
    r = run(
        "import redrafter_mlx, redrafter_mlx._blas as b; print(b.gemm_prefetch())",
        REDRAFTER_GEMM_PREFETCH="far",
    )
    assert r.stdout.strip() == "512"
    assert "REDRAFTER_GEMM_PREFETCH='far' is not an integer; using 512" in r.stderr


def test_large_products_use_the_pool_and_stay_correct():
    rng = np.random.default_rng(0)
    for m, n, k in [
        (1, 4099, 901),
        (3, 9000, 896),
        (16, 2048, 1000),
        (32, 3000, 640),
        (8, 5, 70000),
    ]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        close(mx.array(a) @ mx.array(w).T, reference(a, w.T), k)
        b = rng.standard_normal((k, n), dtype=np.float32)
        close(mx.array(a) @ mx.array(b), reference(a, b), k)


# every tail: K % 16 = 7, 0, 8, 0; and long dot products (an MLP's down projection), where
# 2-4 rows take 4-row blocks or, on Zen 1, one weight row at a time
@pytest.mark.parametrize("k", [903, 896, 136, 128, 4864, 2055])
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 32])  # one weight row per pass, and 4-row blocks
def test_each_row_is_bit_identical_to_that_row_alone(m, k):
    """A tree node's activations get exactly the arithmetic of the same token decoded alone."""
    rng = np.random.default_rng(1)
    n = 4103 if k < 1024 else 517  # odd N: column tails
    w = mx.array(rng.standard_normal((n, k), dtype=np.float32)).T
    x = mx.array(rng.standard_normal((m, k), dtype=np.float32))
    chosen = _blas.gemm_rows_from_l2()
    try:
        for rows_from_l2 in (False, True):  # both long-K paths, whichever this CPU takes
            _blas.gemm_rows_from_l2(rows_from_l2)
            together = np.array(x @ w)
            for i in range(m):
                alone = np.array(x[i : i + 1] @ w)[0]
                assert np.array_equal(together[i], alone), (m, i, rows_from_l2)
    finally:
        _blas.gemm_rows_from_l2(chosen)


def test_few_rows_go_to_the_kernel_and_many_to_the_blas():
    w = mx.random.normal((512, 256))
    before = _blas.handled_products()
    mx.eval(mx.random.normal((4, 256)) @ w.T)
    assert _blas.handled_products() == before + 1
    mx.eval(mx.random.normal((64, 256)) @ w.T)  # prefill-sized: the BLAS's
    assert _blas.handled_products() == before + 1


def test_attention_products_stay_with_the_blas():
    """Scores over a head dimension (K < 128) and probabilities @ values (not x @ W^T): the
    operands are in cache and the BLAS is faster there."""
    before = _blas.handled_products()
    q, keys = mx.random.normal((7, 64)), mx.random.normal((400, 64))
    mx.eval(q @ keys.T)
    mx.eval(mx.random.normal((7, 400)) @ mx.random.normal((400, 64)))
    assert _blas.handled_products() == before


@pytest.mark.skipif("mkl" not in _blas.status, reason="MKL is not the BLAS here")
def test_small_products_run_on_one_mkl_thread():
    """Decoding's attention products go to MKL on one thread (its spinning OpenMP workers took
    the kernel's cores); prompt-sized products keep MKL's threads."""
    before = _blas.serial_products()
    mx.eval(mx.random.normal((21, 64)) @ mx.random.normal((300, 64)).T)
    mx.eval(mx.random.normal((21, 300)) @ mx.random.normal((300, 64)))
    assert _blas.serial_products() == before + 2
    mx.eval(mx.random.normal((512, 896)) @ mx.random.normal((896, 896)))
    assert _blas.serial_products() == before + 2


def test_two_streams_at_once():
    """Each MLX CPU stream has its own thread: concurrent products must not share a job."""
    rng = np.random.default_rng(2)
    k, n = 896, 20000
    w = rng.standard_normal((n, k), dtype=np.float32)
    xs = [rng.standard_normal((3, k), dtype=np.float32) for _ in range(2)]
    results: list = [None, None]

    def work(i: int) -> None:
        with mx.stream(mx.new_stream(mx.cpu)):  # streams belong to the thread making them
            outs = [mx.array(xs[i]) @ mx.array(w).T for _ in range(20)]
            mx.eval(outs)
        results[i] = [np.array(o) for o in outs]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        want = reference(xs[i], w.T)
        for got in results[i]:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_a_forked_child_starts_its_own_pool():
    """Called directly (MLX itself does not survive a fork once it has evaluated anything)."""
    code = (
        "import ctypes, os, numpy as np, redrafter_mlx._blas as b\n"
        "f = b._gemm_lib.cblas_sgemm\n"
        "P = ctypes.POINTER(ctypes.c_float)\n"
        "f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int,"
        " ctypes.c_float, P, ctypes.c_int]\n"
        "a = np.ones((2, 512), np.float32); w = np.ones((8192, 512), np.float32)\n"
        "def product():\n"
        "    c = np.zeros((2, 8192), np.float32); p = lambda x: x.ctypes.data_as(P)\n"
        "    f(101, 111, 112, 2, 8192, 512, 1.0, p(a), 512, p(w), 512, 0.0, p(c), 8192)\n"
        "    return bool((c == 512).all())\n"
        "assert product()\n"  # the parent's pool is running now
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if product() else 3)\n"
        "_, status = os.waitpid(pid, 0); print(os.waitstatus_to_exitcode(status))\n"
    )
    r = run(code)
    assert r.stdout.strip() == "0", r.stdout + r.stderr


def test_rows_zero_turns_it_off():
    r = run(
        "import redrafter_mlx, redrafter_mlx._blas as b, mlx.core as mx;"
        "mx.eval(mx.ones((2, 256)) @ mx.ones((64, 256)).T);"
        "print(b.gemm, b.handled_products(), b.summary())",
        REDRAFTER_GEMM_ROWS="0",
    )
    gemm, handled, *_ = r.stdout.split()
    assert (gemm, handled) == ("off", "0"), r.stdout + r.stderr
    assert "few-row gemm off" in r.stdout


def test_a_bad_setting_is_named_and_the_default_kept():
    r = run(
        "import redrafter_mlx, redrafter_mlx._blas as b; print(b.gemm)",
        REDRAFTER_GEMM_THREADS="many",
    )
    assert r.stdout.strip() == "on"
    assert "REDRAFTER_GEMM_THREADS='many' is not an integer; using 0" in r.stderr
