"""Triton gather-sum: Y[j] = sum_k G[j, k] V[idx[j, k]] (= Yd V); padding ignored."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import BLOCK_D, block_k


@triton.jit
def _gather_sum_kernel(V, IDX, G, Y, K, d, D, stride_vr, stride_vc,
                       BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        rows = tl.load(IDX + j * K + ks, mask=kmask, other=-1).to(tl.int64)
        valid = kmask & (rows >= 0) & (rows < D)
        rows = tl.where(valid, rows, 0)
        g = tl.load(G + j * K + ks, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * stride_vr + cols[None, :] * stride_vc,
                    mask=valid[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(g[:, None] * v, axis=0)
    tl.store(Y + j * d + cols, acc.to(Y.dtype.element_ty), mask=cmask)


def gather_sum(V: Tensor, idx: Tensor, G: Tensor) -> Tensor:
    """Y[j] = sum_k G[j, k] V[idx[j, k]] in the promoted dtype; padding ignored."""
    m, K = idx.shape
    d = V.shape[1]
    Y = torch.empty(m, d, dtype=torch.promote_types(V.dtype, G.dtype), device=V.device)
    if m == 0 or d == 0:
        return Y
    if K == 0:
        return Y.zero_()
    idx, G = idx.contiguous(), G.contiguous()
    grid = (m, triton.cdiv(d, BLOCK_D))
    _gather_sum_kernel[grid](V, idx, G, Y, K, d, V.shape[0], V.stride(0), V.stride(1),
                             BLOCK_K=block_k(K), BLOCK_D=BLOCK_D)
    return Y
