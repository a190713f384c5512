"""The Triton implementations, checked, with the same signatures as ``reference``: made
from the table (ops.py). ``dispatch`` uses them for CUDA tensors; on CPU the kernels run
only under ``TRITON_INTERPRET=1`` (the tests). The kernel modules are named
``*_kernel(s)`` so that importing them does not replace the package-level functions of
the same name (``lst_kernels.gather_dot`` stays the dispatcher).
"""
from __future__ import annotations

from .ops import OPS, checked


def _launcher(name: str):
    fn = OPS[name].triton()
    return checked(OPS[name], lambda _: fn)


gather_dot = _launcher("gather_dot")
gather_sum = _launcher("gather_sum")
scatter_add_rows_ = _launcher("scatter_add_rows_")
sparse_gram = _launcher("sparse_gram")
m_matrix = _launcher("m_matrix")
q_update = _launcher("q_update")

__all__ = list(OPS)
