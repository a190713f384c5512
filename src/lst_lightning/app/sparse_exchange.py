"""Row-sparse gradients averaged over the processes by all-gathers, on any backend.

A sparse input embedding (``nn.Embedding(sparse=True)``) and a ``head.sparse`` head's
class rows get row-sparse gradients: (row ids, rows), only the rows a step read. DDP
all-reduces those only over gloo; NCCL has no sparse all-reduce. So the app keeps these
parameters out of DDP (``LanguageModel.setup``) and averages their gradients itself, the
same way on every backend:

1. each rank coalesces its gradient (n_r distinct rows);
2. all-gathers the counts n_r, pads its ids and rows to n = max n_r, all-gathers them;
3. keeps the first n_r of rank r's, concatenates, coalesces (rows touched by several
   ranks are summed) and divides by the world size, as DDP averages.

Each rank receives world x (8 + n x (8 + row bytes)) bytes: it depends on the rows the
step touched, never on the number of rows D of the table.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def average_row_sparse(grad: Tensor, group=None) -> tuple[Tensor, int]:
    """The average over the ranks of the row-sparse gradient ``grad`` (a sparse COO
    tensor of sparse dim 1, as an embedding's backward gives, repeated rows allowed),
    coalesced; and the bytes this rank received. One process: ``grad`` coalesced, 0."""
    if not grad.is_sparse or grad.sparse_dim() != 1:
        raise ValueError(f"a row-sparse gradient is a sparse COO tensor with sparse_dim 1, got "
                         f"{'sparse_dim ' + str(grad.sparse_dim()) if grad.is_sparse else 'a dense tensor'}")
    grad = grad.coalesce()
    world = _world(group)
    if world == 1:
        return grad, 0
    ids, rows = grad.indices()[0], grad.values()
    count = torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in torch.cat(counts).tolist()]
    n = max(sizes)
    received = world * count.element_size()
    if n == 0:  # no rank touched a row
        return grad, received
    pad = n - ids.numel()
    ids = torch.cat([ids, ids.new_zeros(pad)])
    rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))])
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    all_rows = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(all_ids, ids, group=group)
    dist.all_gather(all_rows, rows, group=group)
    ids = torch.cat([t[:k] for t, k in zip(all_ids, sizes)])
    rows = torch.cat([t[:k] for t, k in zip(all_rows, sizes)])
    # the ids come from coalesced gradients of this shape: no invariant check needed
    total = torch.sparse_coo_tensor(ids[None], rows, grad.shape, check_invariants=False).coalesce()
    received += world * n * (ids.element_size() + math.prod(rows.shape[1:]) * rows.element_size())
    averaged = torch.sparse_coo_tensor(total.indices(), total.values() / world, grad.shape, is_coalesced=True,
                                       check_invariants=False)
    return averaged, received


@torch.no_grad()
def average_sparse_gradients(params: Iterable[nn.Parameter], group=None) -> int:
    """Replace each parameter's row-sparse gradient by its average over the ranks (every
    rank must pass the same parameters in the same order); a rank that has no gradient
    for one takes part with no rows. Returns the bytes this rank received."""
    received = 0
    if _world(group) == 1:
        return 0
    for p in params:
        grad = p.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                           p.new_empty((0, *p.shape[1:])), p.shape)
        averaged, n = average_row_sparse(grad, group)
        received += n
        if p.grad is not None or averaged._nnz():
            p.grad = averaged
    return received
