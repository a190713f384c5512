"""Triton sparse Gram matrix: (Yd Yd^T)[i, j] = sum_{k,l} G[i,k] G[j,l] [idx[i,k] == idx[j,l] >= 0]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


BLOCK = 32


@triton.jit
def _sparse_gram_kernel(IDX, G, Y, m, K, BLOCK: tl.constexpr):
    ri = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rj = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mi = ri < m
    mj = rj < m
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in tl.range(0, K):
        a = tl.load(IDX + ri * K + k, mask=mi, other=-1)
        ga = tl.load(G + ri * K + k, mask=mi & (a >= 0), other=0.0).to(tl.float32)
        for l in tl.range(0, K):
            b = tl.load(IDX + rj * K + l, mask=mj, other=-1)
            gb = tl.load(G + rj * K + l, mask=mj & (b >= 0), other=0.0).to(tl.float32)
            same = (a[:, None] == b[None, :]) & (a[:, None] >= 0)
            acc += tl.where(same, ga[:, None] * gb[None, :], 0.0)
    tl.store(Y + ri[:, None] * m + rj[None, :], acc.to(Y.dtype.element_ty), mask=mi[:, None] & mj[None, :])


def sparse_gram(idx: Tensor, G: Tensor) -> Tensor:
    """The m x m Yd Yd^T in G's dtype (float32 accumulation); padding contributes nothing."""
    m, K = idx.shape
    Y = torch.empty(m, m, dtype=G.dtype, device=G.device)
    if m == 0:
        return Y
    if K == 0:
        return Y.zero_()
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(m, BLOCK))
    _sparse_gram_kernel[grid](idx.contiguous(), G.contiguous(), Y, m, K, BLOCK=BLOCK)
    return Y
