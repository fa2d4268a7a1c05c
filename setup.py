"""Build the few-row GEMM kernel that redrafter_mlx/_blas.py puts in front of the BLAS on Linux.

Everything else about the package is in pyproject.toml. The kernel is a plain shared library
(no Python API; ctypes loads it), optional: where it cannot be built, decoding uses the BLAS
alone and ``redrafter bench`` says so.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "redrafter_mlx._skinny_gemm",
            sources=["redrafter_mlx/_skinny_gemm.c"],
            # Contract a * b + c into FMA everywhere, so every path computes alike.
            extra_compile_args=["-O3", "-ffp-contract=fast", "-std=gnu11"],
            libraries=["pthread", "dl", "m"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
