"""Triton deterministic scatter: V[idx[j, k]] += alpha * G[j, k] * X[j], in place.

No float atomics: the flat indices are sorted stably (so equal rows keep batch
order), the program at the start of each run of equal indices sums the run in
that fixed order and writes its row of V once. Same inputs, same bits. The run is summed in
float32; a float64 V adds that sum to its rows in float64 (its values are never rounded).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import BLOCK_D, scalar_arg
from .torch_ops import SortedIds


@triton.jit
def _scatter_add_rows_kernel(V, KEYS, PERM, G, X, ALPHA, n, K, d, D, stride_vr, stride_vc,
                             ALPHA_PTR: tl.constexpr, BLOCK_D: tl.constexpr, FP64: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(KEYS + p)
    prev = tl.load(KEYS + p - 1, mask=p > 0, other=-2)
    # Only the first slot of each run of equal rows does the work (one writer per row).
    if (prev != row) & (row >= 0) & (row < D):
        if ALPHA_PTR:
            alpha = tl.load(ALPHA).to(tl.float32)
        else:
            alpha = ALPHA
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cmask = cols < d
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        q = p
        key = row
        while key == row:  # the run, in batch order (the sort was stable)
            src = tl.load(PERM + q)  # flat position j * K + k in the batch
            g = tl.load(G + src).to(tl.float32)
            x = tl.load(X + (src // K) * d + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += g * x
            q += 1
            key = tl.load(KEYS + q, mask=q < n, other=-2)
        ptr = V + row.to(tl.int64) * stride_vr + cols * stride_vc
        if FP64:  # V keeps its float64 values: only the sum of the run is float32
            old = tl.load(ptr, mask=cmask)
            tl.store(ptr, old + (alpha * acc).to(tl.float64), mask=cmask)
        else:
            old = tl.load(ptr, mask=cmask).to(tl.float32)
            tl.store(ptr, (old + alpha * acc).to(V.dtype.element_ty), mask=cmask)


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor,
                      order: SortedIds | None = None) -> Tensor:
    """V[idx[j, k]] += alpha * G[j, k] * X[j], in place, deterministic; returns V. ``order``:
    the ids' ``SortedIds`` when the caller has it."""
    m, K = idx.shape
    D, d = V.shape
    if m * K == 0 or d == 0:
        return V
    # One sort on the device, no host sync: a fixed grid of m*K programs finds the runs.
    keys, perm = SortedIds.sort(idx) if order is None else order
    alpha_arg, alpha_ptr = scalar_arg(alpha)
    grid = (m * K, triton.cdiv(d, BLOCK_D))
    _scatter_add_rows_kernel[grid](V, keys, perm, G.contiguous(), X.contiguous(), alpha_arg,
                                   m * K, K, d, D, V.stride(0), V.stride(1),
                                   ALPHA_PTR=alpha_ptr, BLOCK_D=BLOCK_D, FP64=V.dtype == torch.float64)
    return V
