"""Plain-torch references for the sparse operations of the factored head.

Shapes: ``V`` (D, d); ``idx`` (m, K) int64 with -1 for padding; ``G`` (m, K);
``X`` (m, d). Each Triton kernel in this package has the same signature and is
tested against the function here.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _safe(idx: Tensor) -> tuple[Tensor, Tensor]:
    valid = idx >= 0
    return idx.clamp(min=0), valid


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None) -> Tensor:
    """A[j, k] = X[j] . V[idx[j, k]] + x0[j]; padding slots give 0."""
    safe, valid = _safe(idx)
    rows = V[safe].to(X.dtype)  # (m, K, d)
    A = torch.einsum("mkd,md->mk", rows, X)
    if x0 is not None:
        A = A + x0[:, None]
    return torch.where(valid, A, torch.zeros((), dtype=A.dtype, device=A.device))


def gather_sum(V: Tensor, idx: Tensor, G: Tensor) -> Tensor:
    """Y[j] = sum_k G[j, k] V[idx[j, k]] (padding ignored): Yd V."""
    safe, valid = _safe(idx)
    w = torch.where(valid, G, torch.zeros((), dtype=G.dtype, device=G.device))
    return torch.einsum("mk,mkd->md", w, V[safe].to(G.dtype))


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float) -> Tensor:
    """V[idx[j, k]] += alpha * G[j, k] * X[j], in place; repeated rows accumulate.

    Deterministic: contributions to one row are summed in a fixed order (by
    position in the batch) before a single add into V.
    """
    m, K = idx.shape
    flat = idx.reshape(-1)
    keep = flat >= 0
    rows = flat[keep]
    contrib = (G.reshape(-1, 1) * X.repeat_interleave(K, dim=0))[keep]  # (n, d)
    uniq, inv = torch.unique(rows, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), X.shape[1], dtype=contrib.dtype, device=V.device)
    # Stable order: index_add over a sorted permutation is sequential on CPU.
    order = torch.argsort(inv, stable=True)
    summed.index_add_(0, inv[order], contrib[order])
    V.index_add_(0, uniq, (alpha * summed).to(V.dtype))
    return V


def sparse_gram(idx: Tensor, G: Tensor) -> Tensor:
    """The m x m Yd Yd^T: sum over k, l of G[i,k] G[j,l] [idx[i,k] == idx[j,l] != -1]."""
    m, K = idx.shape
    flat = idx.reshape(-1)
    g = torch.where(flat >= 0, G.reshape(-1), torch.zeros((), dtype=G.dtype, device=G.device))
    same = (flat[:, None] == flat[None, :]) & (flat[:, None] >= 0)
    P = torch.where(same, g[:, None] * g[None, :], torch.zeros((), dtype=G.dtype, device=G.device))
    return P.reshape(m, K, m, K).sum(dim=(1, 3))
