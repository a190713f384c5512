"""Sparse operations of the exact factored output layer (docs/kernels.md).

One public function per op (``functional.py``): its argument check, then Triton on CUDA
tensors when Triton is importable, the plain-torch implementation otherwise (CPU, or
``LST_KERNELS=torch``; ``impl=`` forces either). ``ops_for(device, impl="auto")`` makes that
choice once and hands back its ``Ops``, the same implementations unchecked (``ops.py``; the
plain-torch ones in ``reference.py`` and ``torch_ops.py``, the Triton ones in
``triton_ops.py`` over each launcher of ``<op>_kernel(s).py``). ``SortedIds`` is the sort of a
step's ids that the ops which sort them can share (``order=``).
"""
from __future__ import annotations

from . import reference
from .functional import (SortedIds, fold_rows_, gather_dot, gather_sum, gram_rows, logsumexp_rows, m_matrix, q_update,
                         q_update_factors, scatter_add_rows_, sparse_gram)
from .ops import Ops, ops_for

__all__ = [
    "gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "gram_rows", "m_matrix", "q_update",
    "q_update_factors", "logsumexp_rows", "fold_rows_", "SortedIds", "reference", "Ops", "ops_for",
]
