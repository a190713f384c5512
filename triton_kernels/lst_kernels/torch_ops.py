"""The plain-torch implementation of the ops, unchecked (``ops.TORCH``: the CPU's, and CUDA's
without Triton or with ``LST_KERNELS=torch``), and ``SortedIds``, the sort of a step's ids that
both implementations share.

Three sparse ops run their reference as it is (``reference.py``: ``ops.TORCH`` holds it). The
scatter here is the reference's sums in static shapes (no host read: ``torch.compile`` takes it
whole), tested bit for bit against it; ``m_matrix`` and ``q_update`` run the same products
arranged in two GEMMs each, tested against the term-by-term references. ``gram_rows`` and
``q_update_factors`` (Q's update without the m x m M, for m > d: spherical/exact_step.py) have
no kernel of their own; ``logsumexp_rows`` neither: the Triton implementation runs them as here
(``gram_rows`` on its deterministic scatter and gather, ``triton_ops.py``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import checks


class SortedIds(NamedTuple):
    """The flat ids of ``idx`` (m, K) sorted stably: ``keys`` (m K,) int64, ascending, padding
    (-1) first, and ``perm``, each key's flat position j K + k (equal ids in batch order)."""

    keys: Tensor
    perm: Tensor

    @classmethod
    def of(cls, idx: Tensor) -> "SortedIds":
        """``sort`` of a checked ``idx`` (int32 or int64, (m, K))."""
        return cls.sort(checks.tensor("idx", idx, (None, None), index=True))

    @classmethod
    def sort(cls, idx: Tensor) -> "SortedIds":
        """The sort of ``idx``, unchecked (the implementations')."""
        return cls(*torch.sort(idx.reshape(-1).to(torch.int64), stable=True))


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor,
                      order: SortedIds | None = None) -> Tensor:
    """V[idx[j, k]] += alpha G[j, k] X[j] in place: the reference's sums in shapes fixed by idx (no
    ``torch.unique``, no boolean mask: no host read, ``torch.compile`` takes it whole). The m K slots
    sorted stably (``order``, or sorted here), each run of equal ids summed in batch order into one
    row of an (m K, d) buffer, then one ``index_add_`` into V, the buffer's unused rows (and the runs of
    padding or of ids outside [0, D)) adding exact zeros to row 0. The reference's bits."""
    m, K = idx.shape
    ct = torch.promote_types(torch.promote_types(G.dtype, X.dtype), V.dtype)
    keys, perm = SortedIds.sort(idx) if order is None else order
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    run = torch.cumsum(first, 0) - 1  # each sorted slot's run of equal ids
    contrib = G.to(ct).reshape(-1, 1) * (X.to(ct) if K == 1 else X.to(ct).repeat_interleave(K, dim=0))
    keep = (keys >= 0) & (keys < V.shape[0])  # padding, and any id outside [0, D) as the kernel: adds nothing
    contrib = torch.where(keep[:, None], contrib.index_select(0, perm), 0.0)
    summed = torch.zeros(m * K, X.shape[1], dtype=ct, device=V.device).index_add_(0, run, contrib)
    rows = torch.zeros_like(keys).scatter_(0, run, torch.where(keep, keys, 0))  # each run's row of V
    return V.index_add_(0, rows, (alpha * summed).to(V.dtype))


#: bytes of V's rows a block of an in-place pass over V on the CPU (the rows the write finds in
#: cache): the gated fold's here, and the head's folds and fixes (lst_lightning.spherical.blocks)
CACHE_BYTES = 2 << 20


def fold_rows_(V: Tensor, M: Tensor, flag: Tensor | bool) -> Tensor:
    """V <- V M in place where ``flag`` (a one-element tensor, or a bool) is true; returns V.
    Compiled, one opaque op of the graph (``_fold_rows_op``, which runs this function eager).
    Eager it reads the flag: on the CPU a load of a CPU value, where nothing waits (on CUDA without
    Triton, a synchronisation). The fold runs over cache-sized blocks of rows and never holds a
    D x d temporary."""
    if torch.compiler.is_compiling():
        _fold_rows_op(V, M, flag)
        return V
    if not bool(flag):
        return V
    M = M.to(V.dtype)
    rows = max(1, CACHE_BYTES // max(1, V.shape[1] * V.element_size()))
    for a in range(0, V.shape[0], rows):
        blk = V[a:a + rows]
        blk.copy_(blk @ M)
    return V


@torch.library.custom_op("lst_kernels::fold_rows_", mutates_args=("V",))
def _fold_rows_op(V: Tensor, M: Tensor, flag: Tensor) -> None:
    """``fold_rows_`` as a ``torch.library`` custom op: one opaque call that mutates V in a compiled
    step (no graph break, no copy of V)."""
    fold_rows_(V, M, flag)


@_fold_rows_op.register_fake
def _(V: Tensor, M: Tensor, flag: Tensor) -> None:
    return None


class Coalesced(NamedTuple):
    """``gram_rows``' slots coalesced to their distinct columns: ``col`` (m, K), each slot's column
    among them, in id order (< m K); ``g`` (m, K), G with padding 0; ``order``, col's stable sort
    (the ids': col is the ids relabelled in their order); ``N``, zeros (m K, d) in the promoted dtype."""

    col: Tensor
    g: Tensor
    order: SortedIds
    N: Tensor


def coalesced(idx: Tensor, G: Tensor, X: Tensor, order: SortedIds | None = None) -> Coalesced:
    """``gram_rows``' first half, on every device (static shapes: no host sync, CUDA graphs
    capture it). ``order``: the ids' ``SortedIds`` made already."""
    m, K = idx.shape
    ids, perm = SortedIds.sort(idx) if order is None else order
    ct = torch.promote_types(G.dtype, X.dtype)
    flat = idx.reshape(-1)
    g = torch.where(flat >= 0, G.reshape(-1).to(ct), torch.zeros((), dtype=ct, device=G.device))  # padding: 0
    first = torch.ones_like(ids)
    first[1:] = ids[1:] != ids[:-1]
    col_sorted = torch.cumsum(first, 0) - 1  # each slot's column among the distinct ones (< m K), in id order
    col = torch.empty_like(col_sorted)
    col[perm] = col_sorted
    N = torch.zeros(m * K, X.shape[1], dtype=ct, device=X.device)
    return Coalesced(col.view(m, K), g.view(m, K), SortedIds(col_sorted, perm), N)


def gram_rows(idx: Tensor, G: Tensor, X: Tensor, order: SortedIds | None = None) -> Tensor:
    """Yd Yd^T X (m, d) in O(m K d), never the m x m Yd Yd^T: the slots coalesced to their
    distinct columns (``coalesced``), N = Yd^T X on them by ``index_add_`` (sequential on the
    CPU), then Yd N."""
    col, g, _, N = coalesced(idx, G, X, order)
    m, K = idx.shape
    Xk = X.to(N.dtype) if K == 1 else X.to(N.dtype).repeat_interleave(K, dim=0)  # each slot's row of X
    N.index_add_(0, col.reshape(-1), g.reshape(-1, 1) * Xk)
    out = g.reshape(-1, 1) * N.index_select(0, col.reshape(-1))
    return out if K == 1 else out.view(m, K, X.shape[1]).sum(1)


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor) -> Tensor:
    """M = dO dO^T (m x m) in two m x m x d GEMMs: with P = 2 diag(g_q) H and
    dH = 2 diag(g_q) Hq + Z, the four H-terms of M are dH P^T + P Z^T."""
    ct = torch.promote_types(torch.promote_types(H.dtype, Hq.dtype), Z.dtype)
    gq, gs, ybar = gq.to(ct), gs.to(ct), ybar.to(ct)
    P = 2.0 * gq[:, None] * H.to(ct)
    Z = Z.to(ct)
    M = torch.addcmul(Z, gq[:, None], Hq.to(ct), value=2.0) @ P.T
    M.addmm_(P, Z.T)
    M += num_classes * torch.outer(gs, gs) + torch.outer(gs, ybar) + torch.outer(ybar, gs) + yy.to(ct)
    return M


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor) -> Tensor:
    """Q_new in two GEMMs: with R = (lr^2 / 2) M H - c lr dH it is c^2 Q + H^T R + (H^T R)^T."""
    H = H.to(Q.dtype)
    R = 0.5 * lr * lr * (M.to(Q.dtype) @ H) - c * lr * dH.to(Q.dtype)
    HtR = H.T @ R
    return c * c * Q + HtR + HtR.T


def q_update_factors(Q: Tensor, H: Tensor, gq: Tensor, Z: Tensor, gs: Tensor, ybar: Tensor, num_classes: int,
                     YYH: Tensor, lr: float | Tensor, c: float | Tensor, *, P: Tensor | None = None,
                     Gq: Tensor | None = None, HYYH: Tensor | None = None, GqP: Tensor | None = None) -> Tensor:
    """``q_update`` without the m x m M, from d x d products (``functional.q_update_factors``)."""
    d = H.shape[1]
    # One GEMM for F = H^T Z, H^T YYH (and G = H^T diag(g_q) H where not given). With
    # R' = D u u^T + u y^T + y u^T + H^T Yd Yd^T H, E = H^T dH = F + 2 G Q and E' = F + G Q:
    #   H^T M H = 2 E G + 2 G F^T + R'   (the reference's terms), and
    #   Q_new = c^2 Q - c lr (P E + E^T P) + lr^2 P H^T M H P = c^2 Q + T + T^T,
    #   T = P (2 lr^2 E' (G P) + (lr^2 / 2) R' P - c lr E)
    # (P E' G P + its transpose = P F G P + (P F G P)^T + 2 (G P)^T Q G P): the d x d products
    # G Q, [E' | R'] [G P; P] and P (...), or without P G Q and E' G.
    ct = torch.promote_types(torch.promote_types(H.dtype, Z.dtype), Q.dtype)
    H, Qc = H.to(ct), Q.to(ct)
    gq, gs, ybar = gq.to(ct), gs.to(ct), ybar.to(ct)
    cols = [Z.to(ct), YYH.to(ct)] if Gq is not None else [gq[:, None] * H, Z.to(ct), YYH.to(ct)]
    B = H.T @ torch.cat(cols, 1)
    G, (F, R) = (Gq.to(ct), B.split(d, 1)) if Gq is not None else (B[:, :d], B[:, d:].split(d, 1))
    uy = H.T @ torch.stack([gs, ybar], 1)
    u, y = uy[:, 0], uy[:, 1]
    R = R + num_classes * torch.outer(u, u) + torch.outer(u, y) + torch.outer(y, u)  # R'
    if HYYH is not None:
        R = R + HYYH.to(ct)
    GQ = G @ Qc
    E1 = F + GQ  # E'
    E = E1 + GQ
    if P is None:
        T = (2.0 * lr * lr) * (E1 @ G)
        T += (0.5 * lr * lr) * R
    else:
        right = P.to(ct)
        GP = G @ right if GqP is None else GqP.to(ct)
        T = torch.cat([E1, R], 1) @ torch.cat([(2.0 * lr * lr) * GP, (0.5 * lr * lr) * right])
    T -= c * lr * E
    if P is not None:
        T = right @ T
    out = T + T.T
    out += c * c * Qc
    return out.to(Q.dtype)


class _LogSumExpRows(torch.autograd.Function):
    """``logsumexp_rows(Z, with_softmax=True)``, p kept for the backward, ``grad * p``."""

    @staticmethod
    def forward(ctx, Z: Tensor) -> Tensor:
        lse, p = logsumexp_rows(Z, with_softmax=True)
        ctx.save_for_backward(p)
        return lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (p,) = ctx.saved_tensors
        return grad * p


def logsumexp_rows(Z: Tensor, with_softmax: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log sum_j exp(Z[i, j]) per row (m, 1), differentiable, by the row max and ``torch.softmax``
    in one pass (``functional.logsumexp_rows``); ``with_softmax``: and softmax(Z), outside autograd."""
    if not with_softmax:
        return _LogSumExpRows.apply(Z)
    with torch.no_grad():  # the row max and the softmax p; p at the max is 1 / sum exp(Z - max)
        top, arg = Z.max(1, keepdim=True)
        p = torch.softmax(Z, 1)
        return top - p.gather(1, arg).log(), p
