"""Triton gather-dot: A[j, k] = X[j] . V[idx[j, k]] + x0[j]; padding gives 0."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import BLOCK_D, block_k


@triton.jit
def _gather_dot_kernel(V, IDX, X, X0, A, K, d, D, stride_vr, stride_vc,
                       HAS_X0: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < K
    rows = tl.load(IDX + j * K + ks, mask=kmask, other=-1).to(tl.int64)
    valid = kmask & (rows >= 0) & (rows < D)  # out-of-range ids are skipped, never read
    rows = tl.where(valid, rows, 0)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for d0 in tl.range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < d
        # Upcast right after the load: bf16 arithmetic is wrong in the interpreter.
        x = tl.load(X + j * d + cols, mask=cmask, other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * stride_vr + cols[None, :] * stride_vc,
                    mask=valid[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(v * x[None, :], axis=1)
    if HAS_X0:
        acc += tl.load(X0 + j).to(tl.float32)
    acc = tl.where(valid, acc, 0.0)
    tl.store(A + j * K + ks, acc.to(A.dtype.element_ty), mask=kmask)


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None) -> Tensor:
    """A[j, k] = X[j] . V[idx[j, k]] + x0[j] in the promoted dtype; padding slots give 0."""
    m, K = idx.shape
    ct = torch.promote_types(V.dtype, X.dtype)
    A = torch.empty(m, K, dtype=ct, device=V.device)
    if m == 0 or K == 0:
        return A
    idx, X = idx.contiguous(), X.contiguous()
    has_x0 = x0 is not None
    x0 = x0.contiguous() if has_x0 else X  # a dummy pointer, never read
    grid = (m, triton.cdiv(K, block_k(K)))
    _gather_dot_kernel[grid](V, idx, X, x0, A, K, V.shape[1], V.shape[0], V.stride(0), V.stride(1),
                             HAS_X0=has_x0, BLOCK_K=block_k(K), BLOCK_D=BLOCK_D)
    return A
