"""Row-sparse gathers: the rows of a class table (W (D, d) or a bias (D,)) that a step
reads, with a gradient that holds only those rows, so that a row-sparse optimiser reads and
writes only them and the step's cost does not grow with D. Two forms: static rows, where the
table has a ``RowGrad`` (``lst_lightning.rows.static_rows``: the gradient as (ids, rows) of the
batch's size, stepped by ``RowAdam``; ``torch.compile`` takes it whole), or a torch sparse COO
tensor (as ``nn.Embedding(sparse=True)`` gives, for ``SparseAdam``)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..rows import row_grad_of


class _RowGather(torch.autograd.Function):
    """``table[ids.clamp(min=0)]``; the gradient is row-sparse and leaves out the
    padding ids (< 0), so a padded slot touches no row (not even row 0, which it reads)."""

    @staticmethod
    def forward(ctx, table: Tensor, ids: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.table_shape = table.shape
        return table[ids.clamp(min=0)]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        rows = grad.reshape(flat.numel(), *ctx.table_shape[1:])
        keep = flat >= 0
        if not bool(keep.all()):
            flat, rows = flat[keep], rows[keep]
        out = torch.sparse_coo_tensor(flat.unsqueeze(0), rows, ctx.table_shape, dtype=grad.dtype,
                                      device=grad.device, check_invariants=False)
        return out, None


def row_gather(table: Tensor, ids: Tensor, sparse: bool) -> Tensor:
    """``table[ids]`` (padding ids < 0 read row 0), shape ``ids.shape + table.shape[1:]``.
    ``sparse``: while autograd records, the gradient of ``table`` is row-sparse (only the
    rows of the real ids, repeats summed by the optimiser): through the table's ``RowGrad``
    where it has one (static rows), else a sparse COO tensor; else dense indexing."""
    rows = row_grad_of(table) if sparse else None
    if rows is not None:
        return rows.gather(table, ids)
    if sparse and torch.is_grad_enabled() and table.requires_grad:
        return _RowGather.apply(table, ids)
    return table[ids.clamp(min=0)]
