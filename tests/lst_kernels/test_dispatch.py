"""The package-level functions are the dispatchers, whatever else is imported."""
from __future__ import annotations

import pytest


def test_package_functions_survive_importing_the_kernels():
    pytest.importorskip("triton")
    import lst_kernels
    from lst_kernels import dispatch, triton_ops  # noqa: F401

    for name in ("gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update"):
        assert getattr(lst_kernels, name) is getattr(dispatch, name)
