"""The bookkeeping products in plain torch, arranged for fewest GEMMs: the
implementation used off CUDA. ``reference.py`` keeps the term-by-term forms
that these are tested against.
"""
from __future__ import annotations

import torch
from torch import Tensor


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor) -> Tensor:
    """M = dO dO^T in two m x m x d GEMMs: with P = 2 diag(g_q) H and dH = 2 diag(g_q) Hq + Z,
    the four H-terms of M are dH P^T + P Z^T."""
    ct = torch.promote_types(torch.promote_types(H.dtype, Hq.dtype), Z.dtype)
    H, Hq, Z, gq, gs, ybar = (t.to(ct) for t in (H, Hq, Z, gq, gs, ybar))
    P = 2.0 * gq[:, None] * H
    dH = torch.addcmul(Z, gq[:, None], Hq, value=2.0)
    M = dH @ P.T
    M.addmm_(P, Z.T)
    M += num_classes * torch.outer(gs, gs) + torch.outer(gs, ybar) + torch.outer(ybar, gs) + yy.to(ct)
    return M


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor) -> Tensor:
    """c^2 Q - c lr (dH^T H + H^T dH) + lr^2 H^T M H in two GEMMs: with
    R = (lr^2 / 2) M H - c lr dH it is c^2 Q + H^T R + (H^T R)^T (M is symmetric)."""
    H, dH, M = H.to(Q.dtype), dH.to(Q.dtype), M.to(Q.dtype)
    R = 0.5 * lr * lr * (M @ H) - c * lr * dH
    HtR = H.T @ R
    return c * c * Q + HtR + HtR.T
