"""Triton gated fold: V <- V M in place, where a device flag says so; nothing otherwise.

The flag is read by the kernel, never by the host: a step under device flags folds a nearly
singular update into V (spherical/exact_step.py) without a host synchronisation, inside a compiled
step or a CUDA graph. With the flag off every program returns after one load.

In place and race-free: each program owns whole blocks of rows (a persistent grid), copies
its block to a scratch block of its own, then writes V's rows from the copy, one block of
columns at a time. Products in the state's dtype: float32 by ``tl.dot`` in IEEE precision
(no TF32), float64 by multiply-adds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: rows a program folds at once; columns of a block of V's rows; the inner dimension's chunk
BLOCK_R, BLOCK_N, BLOCK_K = 16, 64, 16
#: the persistent grid's programs at most (each holds a BLOCK_R x d scratch block)
MAX_PROGRAMS = 256


@triton.jit
def _fold_rows_kernel(V, M, FLAG, SCRATCH, D, d, stride_vr, n_prog,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP64: tl.constexpr):
    p = tl.program_id(0)
    if tl.load(FLAG) != 0:
        local = tl.arange(0, BLOCK_R)
        scratch = SCRATCH + p.to(tl.int64) * BLOCK_R * d
        for start in range(p * BLOCK_R, D, n_prog * BLOCK_R):
            rows = start + local
            rmask = rows < D
            vrows = V + rows.to(tl.int64)[:, None] * stride_vr
            for c0 in range(0, d, BLOCK_N):  # the block's rows, copied
                cols = c0 + tl.arange(0, BLOCK_N)
                mask = rmask[:, None] & (cols < d)[None, :]
                x = tl.load(vrows + cols[None, :], mask=mask, other=0.0)
                tl.store(scratch + local[:, None] * d + cols[None, :], x, mask=mask)
            tl.debug_barrier()
            for c0 in range(0, d, BLOCK_N):  # then written from the copy
                cols = c0 + tl.arange(0, BLOCK_N)
                cmask = cols < d
                if FP64:
                    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float64)
                else:
                    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, d, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    kmask = ks < d
                    a = tl.load(scratch + local[:, None] * d + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                                other=0.0)
                    b = tl.load(M + ks[:, None] * d + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
                    if FP64:
                        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
                    else:
                        acc = tl.dot(a, b, acc, input_precision="ieee")
                tl.store(vrows + cols[None, :], acc.to(V.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
            tl.debug_barrier()  # the next block's copy overwrites the scratch


def fold_rows_(V: Tensor, M: Tensor, flag: Tensor) -> Tensor:
    """V <- V M in place where ``flag`` (a one-element device tensor) is true; returns V."""
    D, d = V.shape
    if D == 0 or d == 0:
        return V
    n_prog = min(triton.cdiv(D, BLOCK_R), MAX_PROGRAMS)
    scratch = torch.empty((n_prog, BLOCK_R, d), dtype=V.dtype, device=V.device)
    _fold_rows_kernel[(n_prog,)](V, M.to(V.dtype).contiguous(), flag.reshape(1).to(torch.int32), scratch, D, d,
                                 V.stride(0), n_prog, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                 FP64=V.dtype == torch.float64)
    return V
