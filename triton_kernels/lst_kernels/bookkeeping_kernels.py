"""Triton kernels for the factored head's bookkeeping: M = dO dO^T and the Q update.

Both outputs are symmetric, so only tiles on or above the diagonal are
computed; each is written twice (itself and its transpose) and diagonal tiles
are symmetrised, which makes the outputs exactly symmetric and halves the work.

M: with a = 2 diag(g_q) H, the dense terms of M are a (a Q + Z)^T + Z a^T
(a Q = 2 diag(g_q) Hq), so one pass over d with two dot products per tile
replaces H Q H^T and H Z^T; the rank-1 terms and Yd Yd^T join in the epilogue.

Q: with P = (lr^2 / 2) M H - c lr dH (one cuBLAS addmm, M symmetric),
Q_new = c^2 Q + H^T P + P^T H, computed tile by tile over m.

Products accumulate in float32; a float64 Q keeps c^2 Q in float64 (its values are never
rounded to float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import scalar_arg, tile


@triton.jit
def _store_symmetric(OUT, n, acc, ri, rj, pi, pj):
    """Write tile (pi, pj) and, off the diagonal, its transpose at (pj, pi)."""
    mi = ri < n
    mj = rj < n
    if pi == pj:
        acc = 0.5 * (acc + tl.trans(acc))
    tl.store(OUT + ri[:, None] * n + rj[None, :], acc, mask=mi[:, None] & mj[None, :])
    if pi != pj:
        tl.store(OUT + rj[:, None] * n + ri[None, :], tl.trans(acc), mask=mj[:, None] & mi[None, :])


@triton.jit
def _m_matrix_kernel(HQ, H, Z, GQ, GS, YBAR, YY, M, m, d, num_classes,
                     BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    pi = tl.program_id(0)
    pj = tl.program_id(1)
    if pi <= pj:
        ri = pi * BLOCK + tl.arange(0, BLOCK)
        rj = pj * BLOCK + tl.arange(0, BLOCK)
        mi = ri < m
        mj = rj < m
        gqi = tl.load(GQ + ri, mask=mi, other=0.0).to(tl.float32)
        gqj = tl.load(GQ + rj, mask=mj, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in tl.range(0, d, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            km = ks < d
            oi = ri[:, None] * d + ks[None, :]
            oj = rj[:, None] * d + ks[None, :]
            li = mi[:, None] & km[None, :]
            lj = mj[:, None] & km[None, :]
            hi = tl.load(H + oi, mask=li, other=0.0).to(tl.float32)
            zi = tl.load(Z + oi, mask=li, other=0.0).to(tl.float32)
            hj = tl.load(H + oj, mask=lj, other=0.0).to(tl.float32)
            hqj = tl.load(HQ + oj, mask=lj, other=0.0).to(tl.float32)
            zj = tl.load(Z + oj, mask=lj, other=0.0).to(tl.float32)
            ai = 2.0 * gqi[:, None] * hi
            aj = 2.0 * gqj[:, None] * hj
            rj_ = 2.0 * gqj[:, None] * hqj + zj  # row j of a Q + Z
            acc += tl.dot(ai, tl.trans(rj_), input_precision="ieee")
            acc += tl.dot(zi, tl.trans(aj), input_precision="ieee")
        gsi = tl.load(GS + ri, mask=mi, other=0.0).to(tl.float32)
        gsj = tl.load(GS + rj, mask=mj, other=0.0).to(tl.float32)
        ybi = tl.load(YBAR + ri, mask=mi, other=0.0).to(tl.float32)
        ybj = tl.load(YBAR + rj, mask=mj, other=0.0).to(tl.float32)
        acc += num_classes * gsi[:, None] * gsj[None, :] + gsi[:, None] * ybj[None, :] + ybi[:, None] * gsj[None, :]
        acc += tl.load(YY + ri[:, None] * m + rj[None, :], mask=mi[:, None] & mj[None, :], other=0.0).to(tl.float32)
        _store_symmetric(M, m, acc.to(M.dtype.element_ty), ri, rj, pi, pj)


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor) -> Tensor:
    """M = dO dO^T (m x m), exactly symmetric; same arguments as the reference."""
    m, d = H.shape
    ct = torch.promote_types(torch.promote_types(H.dtype, Hq.dtype), Z.dtype)
    M = torch.empty(m, m, dtype=ct, device=H.device)
    if m == 0:
        return M
    block = tile(m, max(H.element_size(), Hq.element_size(), Z.element_size()))
    grid = (triton.cdiv(m, block), triton.cdiv(m, block))
    _m_matrix_kernel[grid](Hq.contiguous(), H.contiguous(), Z.contiguous(), gq.contiguous(), gs.contiguous(),
                           ybar.contiguous(), yy.contiguous(), M, m, d, float(num_classes),
                           BLOCK=block, BLOCK_K=32)
    return M


@triton.jit
def _q_update_kernel(Q, H, P, OUT, m, d, C,
                     C_PTR: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, FP64: tl.constexpr):
    pi = tl.program_id(0)
    pj = tl.program_id(1)
    if pi <= pj:
        if FP64:  # c by pointer, in float64 (a host float would reach the kernel as float32)
            c = tl.load(C).to(tl.float64)
        elif C_PTR:
            c = tl.load(C).to(tl.float32)
        else:
            c = C
        ri = pi * BLOCK + tl.arange(0, BLOCK)
        rj = pj * BLOCK + tl.arange(0, BLOCK)
        mi = ri < d
        mj = rj < d
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for r0 in tl.range(0, m, BLOCK_K):
            rs = r0 + tl.arange(0, BLOCK_K)
            rm = rs < m
            li = rm[:, None] & mi[None, :]
            lj = rm[:, None] & mj[None, :]
            hi = tl.load(H + rs[:, None] * d + ri[None, :], mask=li, other=0.0).to(tl.float32)
            p_i = tl.load(P + rs[:, None] * d + ri[None, :], mask=li, other=0.0).to(tl.float32)
            hj = tl.load(H + rs[:, None] * d + rj[None, :], mask=lj, other=0.0).to(tl.float32)
            p_j = tl.load(P + rs[:, None] * d + rj[None, :], mask=lj, other=0.0).to(tl.float32)
            acc += tl.dot(tl.trans(hi), p_j, input_precision="ieee")
            acc += tl.dot(tl.trans(p_i), hj, input_precision="ieee")
        q = tl.load(Q + ri[:, None] * d + rj[None, :], mask=mi[:, None] & mj[None, :], other=0.0)
        if FP64:  # c^2 Q in float64: Q's values are never rounded, only the products are float32
            out = (c * c) * q + acc.to(tl.float64)
        else:
            out = acc + (c * c) * q.to(tl.float32)
        _store_symmetric(OUT, d, out.to(OUT.dtype.element_ty), ri, rj, pi, pj)


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor) -> Tensor:
    """Q_new = c^2 Q - c lr (dH^T H + H^T dH) + lr^2 H^T M H, exactly symmetric (new tensor).

    Q and M are taken as symmetric: only Q's upper triangle is read (its diagonal
    tiles are symmetrised).
    """
    m, d = H.shape
    Hf, dHf, Mf = H.to(Q.dtype).contiguous(), dH.to(Q.dtype).contiguous(), M.to(Q.dtype).contiguous()
    if isinstance(lr, Tensor) or isinstance(c, Tensor):
        # Device scalars: stay off the host (graph capture); two cheap elementwise ops.
        P = (Mf @ Hf) * (0.5 * lr * lr) - (c * lr) * dHf
    else:
        P = torch.addmm(dHf, Mf, Hf, beta=-c * lr, alpha=0.5 * lr * lr)
    out = torch.empty(d, d, dtype=Q.dtype, device=Q.device)
    if d == 0:
        return out
    fp64 = Q.dtype == torch.float64
    if fp64 and not isinstance(c, Tensor):
        c = torch.full((1,), c, dtype=torch.float64, device=Q.device)
    c_arg, c_ptr = scalar_arg(c)
    block = 32
    grid = (triton.cdiv(d, block), triton.cdiv(d, block))
    _q_update_kernel[grid](Q.contiguous(), Hf, P.contiguous(), out, m, d, c_arg,
                           C_PTR=c_ptr, BLOCK=block, BLOCK_K=32, FP64=fp64)
    return out
