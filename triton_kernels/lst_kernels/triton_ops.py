"""The Triton implementation's ops, unchecked (``ops.triton_impl()``, ``ops.ops_for``'s on CUDA, is
made of them): the launchers of ``<op>_kernel(s).py``; ``gram_rows`` on the deterministic scatter and
gather kernels; the fold's kernel on V with unit column stride (torch's fold otherwise); and, with
no kernel of their own, torch's ``q_update_factors``, ``logsumexp_rows`` and the ids' sort.
Importing it imports Triton.
"""
from __future__ import annotations

from torch import Tensor

from . import torch_ops
from .bookkeeping_kernels import m_matrix, q_update
from .fold_rows_kernel import fold_rows_ as _fold_rows_kernel
from .gather_dot_kernel import gather_dot
from .gather_sum_kernel import gather_sum
from .scatter_add_rows_kernel import scatter_add_rows_
from .sparse_gram_kernel import sparse_gram
from .torch_ops import SortedIds, logsumexp_rows, q_update_factors

#: what ``ops.triton_impl()`` takes from here: an op for each of ``Ops``' fields (``SortedIds`` for ``sorted_ids``)
__all__ = ["SortedIds", "fold_rows_", "gather_dot", "gather_sum", "gram_rows", "logsumexp_rows", "m_matrix",
           "q_update", "q_update_factors", "scatter_add_rows_", "sparse_gram"]


def gram_rows(idx: Tensor, G: Tensor, X: Tensor, order: SortedIds | None = None) -> Tensor:
    """Yd Yd^T X as ``torch_ops.gram_rows``, N = Yd^T X and Yd N by the deterministic kernels (no
    float atomics), the scatter handed the columns' sort (the ids': no second sort)."""
    col, g, col_order, N = torch_ops.coalesced(idx, G, X, order)
    scatter_add_rows_(N, col, g, X.to(N.dtype), 1.0, col_order)
    return gather_sum(N, col, g)


def fold_rows_(V: Tensor, M: Tensor, flag: Tensor) -> Tensor:
    """V <- V M in place where the one-element tensor ``flag`` is true, read on the device (the
    kernel); torch's fold where V's columns are strided."""
    if V.stride(1) == 1:
        return _fold_rows_kernel(V, M, flag)
    return torch_ops.fold_rows_(V, M, flag)

