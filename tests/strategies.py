"""Hypothesis strategies shared by the tree tests."""

import numpy as np
from hypothesis import strategies as st


@st.composite
def beam_arrays(draw):
    """Beams [W, L] with a shared root and heavy prefix sharing (tiny alphabet)."""
    W = draw(st.integers(1, 8))
    L = draw(st.integers(1, 6))
    alphabet = draw(st.integers(1, 4))
    root = draw(st.integers(0, 50))
    rest = draw(
        st.lists(
            st.lists(st.integers(0, alphabet - 1), min_size=L - 1, max_size=L - 1),
            min_size=W,
            max_size=W,
        )
    )
    return np.array([[root] + r for r in rest], dtype=np.int32).reshape(W, L)
