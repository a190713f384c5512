"""Row-sparse gradients averaged over the processes by all-gathers, on any backend.

A sparse input embedding (``nn.Embedding(sparse=True)``, or with static rows a
``RowEmbedding``) and a ``head.sparse`` head's class rows get row-sparse gradients: (row ids,
rows), only the rows a step read (torch sparse COO tensors, or static rows' (ids, rows), whose
average is handed back to their ``RowGrad``). DDP
all-reduces those only over gloo; NCCL has no sparse all-reduce. So the app keeps these
parameters out of DDP (``LanguageModel.setup``) and averages their gradients itself, the
same way on every backend:

1. each rank coalesces its gradient (n_r distinct rows);
2. all-gathers the counts n_r, pads its ids and rows to n = max n_r, all-gathers them and
   keeps the first n_r of rank r's (``ProcessGroup.gather_ragged``, the head's ragged
   gather);
3. coalesces (rows touched by several ranks are summed) and divides by the world size,
   as DDP averages.

Each rank receives world x (8 + n x (8 + row bytes)) bytes: it depends on the rows the
step touched, never on the number of rows D of the table.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..rows import row_grad_of
from ..spherical.collectives import ProcessGroup


@torch.no_grad()
def average_row_sparse(grad: Tensor, group=None) -> tuple[Tensor, int]:
    """The average over the ranks of the row-sparse gradient ``grad`` (a sparse COO
    tensor of sparse dim 1, as an embedding's backward gives, repeated rows allowed),
    coalesced; and the bytes this rank received. One process: ``grad`` coalesced, 0."""
    if not grad.is_sparse or grad.sparse_dim() != 1:
        raise ValueError(f"a row-sparse gradient is a sparse COO tensor with sparse_dim 1, got "
                         f"{'sparse_dim ' + str(grad.sparse_dim()) if grad.is_sparse else 'a dense tensor'}")
    grad = grad.coalesce()
    pg = ProcessGroup.current(group)
    if pg.world == 1:
        return grad, 0
    (ids, rows), sizes = pg.gather_ragged([grad.indices()[0], grad.values()], [0, 0.0])
    n = max(sizes)
    received = pg.world * 8  # the counts, int64
    if n == 0:  # no rank touched a row
        return grad, received
    # the ids come from coalesced gradients of this shape: no invariant check needed
    total = torch.sparse_coo_tensor(ids[None], rows, grad.shape, check_invariants=False).coalesce()
    received += pg.world * n * (ids.element_size() + math.prod(rows.shape[1:]) * rows.element_size())
    averaged = torch.sparse_coo_tensor(total.indices(), total.values() / pg.world, grad.shape, is_coalesced=True,
                                       check_invariants=False)
    return averaged, received


@torch.no_grad()
def average_sparse_gradients(params: Iterable[nn.Parameter], group=None) -> int:
    """Replace each parameter's row-sparse gradient by its average over the ranks (every
    rank must pass the same parameters in the same order); a rank that has no gradient
    for one takes part with no rows. Returns the bytes this rank received."""
    received = 0
    if ProcessGroup.current(group).world == 1:
        return 0
    for p in params:
        rows = row_grad_of(p)
        if rows is not None:  # static rows (lst_lightning.rows): their (ids, rows) as a sparse gradient
            got = rows.grad()
            ids, values = got if got is not None else (p.new_empty(0, dtype=torch.int64), p.new_empty((0, *p.shape[1:])))
            keep = ids >= 0
            grad = torch.sparse_coo_tensor(ids[keep][None], values[keep], p.shape, check_invariants=False)
            averaged, n = average_row_sparse(grad, group)
            received += n
            if got is not None or averaged._nnz():
                rows.set_grad(averaged.indices()[0], averaged.values())
            continue
        grad = p.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                           p.new_empty((0, *p.shape[1:])), p.shape)
        averaged, n = average_row_sparse(grad, group)
        received += n
        if p.grad is not None or averaged._nnz():
            p.grad = averaged
    return received
