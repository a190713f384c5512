"""The Triton implementations, with the same signatures as ``reference``.

``dispatch`` uses this module for CUDA tensors; on CPU the kernels run only
under ``TRITON_INTERPRET=1`` (the tests). The kernel modules are named
``*_kernel(s)`` so that importing them does not replace the package-level
functions of the same name (``lst_kernels.gather_dot`` stays the dispatcher).
"""
from __future__ import annotations

from .bookkeeping_kernels import m_matrix, q_update
from .gather_dot_kernel import gather_dot
from .gather_sum_kernel import gather_sum
from .scatter_add_rows_kernel import scatter_add_rows_
from .sparse_gram_kernel import sparse_gram

__all__ = ["gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update"]
