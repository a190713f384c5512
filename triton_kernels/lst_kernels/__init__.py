"""Sparse operations of the exact factored output layer.

Each op has a plain-torch reference (``lst_kernels.reference``) and, where
written, a Triton kernel with the same signature. The functions exported here
dispatch: Triton on CUDA tensors when Triton is importable, the torch
reference otherwise (CPU, or ``LST_KERNELS=torch``).
"""
from __future__ import annotations

from . import reference
from .dispatch import gather_dot, gather_sum, m_matrix, q_update, scatter_add_rows_, sparse_gram

__all__ = [
    "gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update", "reference",
]
