"""Plain-torch references for the sparse operations of the factored head.

Shapes: ``V`` (D, d); ``idx`` (m, K) int64 with -1 for padding; ``G`` (m, K);
``X`` (m, d). An id outside [0, D) is skipped like padding, as the kernels skip it. Each Triton kernel in this package has the same signature and is
tested against the function here, and off CUDA the plain-torch implementation
(``ops.TORCH``) runs three of the sparse ones as they are (the scatter, the same sums in
static shapes: ``torch_ops.py``). Arithmetic is done in the promoted dtype of
the inputs, so bf16 activations meet a float32 ``V`` in float32.
"""
from __future__ import annotations

import torch
from torch import Tensor


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None) -> Tensor:
    """A[j, k] = X[j] . V[idx[j, k]] + x0[j]; padding slots give 0."""
    ct = torch.promote_types(V.dtype, X.dtype)
    valid = (idx >= 0) & (idx < V.shape[0])  # padding, and any id outside [0, D) as the kernels: skipped
    safe = torch.where(valid, idx, 0)
    rows = V.index_select(0, safe.reshape(-1)).view(*idx.shape, V.shape[1]).to(ct)  # (m, K, d): V[safe]
    A = torch.einsum("mkd,md->mk", rows, X.to(ct))
    if x0 is not None:
        A = A + x0.to(ct)[:, None]
    return torch.where(valid, A, torch.zeros((), dtype=A.dtype, device=A.device))


def gather_sum(V: Tensor, idx: Tensor, G: Tensor) -> Tensor:
    """Y[j] = sum_k G[j, k] V[idx[j, k]] (padding ignored): Yd V."""
    ct = torch.promote_types(V.dtype, G.dtype)
    valid = (idx >= 0) & (idx < V.shape[0])  # padding, and any id outside [0, D) as the kernels: skipped
    safe = torch.where(valid, idx, 0)
    w = torch.where(valid, G.to(ct), torch.zeros((), dtype=ct, device=G.device))
    return torch.einsum("mk,mkd->md", w, V.index_select(0, safe.reshape(-1)).view(*idx.shape, V.shape[1]).to(ct))


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor) -> Tensor:
    """V[idx[j, k]] += alpha * G[j, k] * X[j], in place; repeated rows accumulate.

    Deterministic: contributions to one row are summed in a fixed order (by
    position in the batch) before a single add into V.
    """
    m, K = idx.shape
    ct = torch.promote_types(torch.promote_types(G.dtype, X.dtype), V.dtype)
    flat = idx.reshape(-1)
    keep = (flat >= 0) & (flat < V.shape[0])  # padding, and any id outside [0, D): skipped
    rows = flat[keep]
    contrib = (G.to(ct).reshape(-1, 1) * X.to(ct).repeat_interleave(K, dim=0))[keep]  # (n, d)
    uniq, inv = torch.unique(rows, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), X.shape[1], dtype=ct, device=V.device)
    # Stable order: index_add over a sorted permutation is sequential on CPU.
    order = torch.argsort(inv, stable=True)
    summed.index_add_(0, inv[order], contrib.index_select(0, order))
    V.index_add_(0, uniq, (alpha * summed).to(V.dtype))
    return V


def sparse_gram(idx: Tensor, G: Tensor) -> Tensor:
    """The m x m Yd Yd^T: sum over k, l of G[i,k] G[j,l] [idx[i,k] == idx[j,l] != -1]."""
    m, K = idx.shape
    flat = idx.reshape(-1)
    zero = torch.zeros((), dtype=G.dtype, device=G.device)
    g = torch.where(flat >= 0, G.reshape(-1), zero)  # padding contributes 0 to every pair
    P = torch.where(flat[:, None] == flat[None, :], torch.outer(g, g), zero)
    return P.reshape(m, K, m, K).sum(dim=(1, 3))


def gram_rows(idx: Tensor, G: Tensor, X: Tensor) -> Tensor:
    """Yd Yd^T X (m, d): the m x m ``sparse_gram`` times X."""
    return sparse_gram(idx, G).to(torch.promote_types(G.dtype, X.dtype)) @ X.to(torch.promote_types(G.dtype, X.dtype))


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor) -> Tensor:
    """M = dO dO^T (m x m) from its factors, term by term as in docs/algorithm.md.

    ``Hq = H Q``, ``Z = (g_s 1^T + Yd) W``, ``ybar = rowsum(G_A)``,
    ``yy = sparse_gram(idx, G_A)`` (= Yd Yd^T), ``num_classes = D``.
    """
    ct = torch.promote_types(torch.promote_types(H.dtype, Hq.dtype), Z.dtype)
    H, Hq, Z = H.to(ct), Hq.to(ct), Z.to(ct)
    gq, gs, ybar = gq.to(ct), gs.to(ct), ybar.to(ct)
    HQH = Hq @ H.T  # H Q H^T
    HZ = H @ Z.T
    return (4 * gq[:, None] * HQH * gq[None, :]
            + num_classes * gs[:, None] * gs[None, :]
            + yy.to(ct)
            + gs[:, None] * ybar[None, :] + ybar[:, None] * gs[None, :]
            + 2 * gq[:, None] * HZ + 2 * HZ.T * gq[None, :])


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor) -> Tensor:
    """Q_new = c^2 Q - c lr (dH^T H + H^T dH) + lr^2 H^T M H, a new (d, d) tensor.

    This is W_new^T W_new for W_new = c W - lr dO^T H when Q = W^T W,
    dH = dO W and M = dO dO^T.
    """
    H, dH, M = H.to(Q.dtype), dH.to(Q.dtype), M.to(Q.dtype)
    return c * c * Q - c * lr * (dH.T @ H + H.T @ dH) + lr * lr * (H.T @ M @ H)


def q_update_factors(Q: Tensor, H: Tensor, gq: Tensor, Z: Tensor, gs: Tensor, ybar: Tensor, num_classes: int,
                     YYH: Tensor, lr: float | Tensor, c: float | Tensor, *, P: Tensor | None = None,
                     Gq: Tensor | None = None, HYYH: Tensor | None = None) -> Tensor:
    """``q_update`` without M, term by term from dO = 2 diag(g_q) H W^T + g_s 1^T + Yd; with a
    right preconditioner ``P`` (symmetric) the Gram of W_new = c W - lr dO^T H P.

    With G = H^T diag(g_q) H (``Gq`` when given), F = H^T Z, u = H^T g_s, y = H^T ybar and
    ``YYH`` = Yd Yd^T H (``HYYH``, when given, a further d x d part of H^T Yd Yd^T H):
    dH^T H = 2 Q G + F^T (so H^T dH = E = 2 G Q + F) and
    H^T M H = (H^T dO)(H^T dO)^T = 4 G Q G + 2 G F^T + 2 F G + D u u^T + u y^T + y u^T + H^T Yd Yd^T H
    (the cross terms of 2 G W^T with u 1^T and H^T Yd add up to 2 G F^T, as Z = g_s wbar^T + Yd W).
    With the right preconditioner R (``P`` here): W^T dO^T H R = E^T R, and H^T M H becomes R H^T M H R.
    """
    ct = torch.promote_types(torch.promote_types(H.dtype, Z.dtype), Q.dtype)
    R = None if P is None else P.to(ct)
    H, Z, YYH, Q = H.to(ct), Z.to(ct), YYH.to(ct), Q.to(ct)
    gq, gs, ybar = gq.to(ct), gs.to(ct), ybar.to(ct)
    G = H.T @ (gq[:, None] * H) if Gq is None else Gq.to(ct)
    F = H.T @ Z
    u, y = H.T @ gs, H.T @ ybar
    HYYH = H.T @ YYH if HYYH is None else H.T @ YYH + HYYH.to(ct)
    E = 2 * G @ Q + F
    HMH = (4 * G @ Q @ G + 2 * G @ F.T + 2 * F @ G + num_classes * torch.outer(u, u)
           + torch.outer(u, y) + torch.outer(y, u) + HYYH)
    if R is not None:
        E, HMH = R @ E, R @ HMH @ R
    return c * c * Q - c * lr * (E + E.T) + lr * lr * HMH


def logsumexp_rows(Z: Tensor, with_softmax: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log sum_j exp(Z[i, j]) per row, (m, 1); -inf entries take no mass. ``with_softmax``: and softmax(Z)."""
    lse = torch.logsumexp(Z, 1, keepdim=True)
    return (lse, torch.softmax(Z, 1)) if with_softmax else lse


def fold_rows_(V: Tensor, M: Tensor, flag: Tensor | bool) -> Tensor:
    """V <- V M in place where ``flag``, else nothing."""
    if bool(flag):
        V.copy_(V @ M.to(V.dtype))
    return V
