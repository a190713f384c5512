"""The Triton implementations, with the same signatures as ``reference``.

``dispatch`` uses this module for CUDA tensors; on CPU the kernels run only
under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

from .bookkeeping import m_matrix, q_update
from .gather_dot import gather_dot
from .gather_sum import gather_sum
from .scatter_add_rows import scatter_add_rows_
from .sparse_gram import sparse_gram

__all__ = ["gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update"]
