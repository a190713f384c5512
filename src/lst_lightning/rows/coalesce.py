"""``coalesce_rows``: the rows of repeated ids summed, by a sort of fixed size (static shapes: no
``torch.unique``, no boolean mask, no host read), what ``Tensor.coalesce()`` does for a sparse COO
gradient whose size changes with the data."""
from __future__ import annotations

import torch
from torch import Tensor


def coalesce_rows(ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``ids`` (n,) int64, -1 for padding, and their ``rows`` (n, ...): each distinct id once, its
    rows summed in batch order, as ``(uids, summed)`` of n slots each: ``uids`` ascending, -1 on the
    slots no id fills (and on the padding's, which comes first), ``summed`` zero on the slots no id fills."""
    n = ids.shape[0]
    if rows.shape[0] != n:
        raise ValueError(f"ids ({n},) and rows {tuple(rows.shape)} must have as many rows")
    keys, perm = torch.sort(ids, stable=True)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    run = torch.cumsum(first, 0) - 1  # each sorted slot's run of equal ids, in id order
    summed = torch.zeros_like(rows).index_add_(0, run, rows.index_select(0, perm))
    uids = torch.full_like(keys, -1).scatter_(0, run, keys)  # a run's slots all write its id
    return uids, summed
