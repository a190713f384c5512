"""The sparse ops of the factored head: one public function per op.

Each function checks its arguments first (bad input raises TypeError/ValueError before
anything runs or changes), then picks its implementation inline: the Triton launcher of
``<op>_kernel(s).py`` for CUDA tensors when Triton is importable, the plain-torch one
otherwise. ``impl`` forces the choice ("torch", "triton"; "auto" also honours
``LST_KERNELS=torch``). The torch implementation of three sparse ops is the reference
itself (``reference.py``), and the scatter's is the reference's sums in static shapes (no
host read: ``torch.compile`` takes it whole), tested bit for bit against it; ``m_matrix`` and ``q_update`` run the same products arranged in
two GEMMs each, tested against the term-by-term references. ``gram_rows`` and
``q_update_factors`` (Q's update without the m x m M, for m > d: spherical/exact_step.py)
have no kernel of their own: a sort, the deterministic scatter and gather (Triton on CUDA)
and torch's GEMMs on every device. ``SortedIds.of(idx)`` is the one sort of a step's ids that
``gram_rows``, the scatter inside it and the write's ``scatter_add_rows_`` can share (``order=``):
one device sort instead of three, the same bits.

Index values are not range-checked here (that needs a host sync): padding is -1, and the
Triton kernels skip any index outside [0, D).

Shapes: ``V`` (D, d); ``idx`` (m, K) int64 or int32, -1 for padding; ``G`` (m, K);
``X``, ``H`` (m, d); ``Q`` (d, d); ``M`` (m, m).
"""
from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch
from torch import Tensor

from . import reference

IMPLS = ("auto", "torch", "triton")
_INDEX_DTYPES = (torch.int32, torch.int64)
_TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def _tensor(name: str, t: object, shape: tuple, index: bool = False) -> Tensor:
    """``t`` as a tensor of ``shape`` (None: any size), floating, or int32/int64 with ``index``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if index and t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int64 or int32 (-1 for padding), got {t.dtype}")
    if not index and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    ok = t.dim() == len(shape)
    for n, want in zip(t.shape, shape):
        ok &= want is None or n == want
    if not ok:
        raise ValueError(f"{name} must have shape {tuple('*' if s is None else s for s in shape)}, "
                         f"got {tuple(t.shape)}")
    return t


def _scalar(name: str, x: object) -> None:
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(x.shape)}")
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(x).__name__}")


class SortedIds(NamedTuple):
    """The flat ids of ``idx`` (m, K) sorted stably: ``keys`` (m K,) int64, ascending, padding
    (-1) first, and ``perm``, each key's flat position j K + k (equal ids in batch order)."""

    keys: Tensor
    perm: Tensor

    @classmethod
    def of(cls, idx: Tensor) -> "SortedIds":
        flat = _tensor("idx", idx, (None, None), index=True).reshape(-1).to(torch.int64)
        return cls(*torch.sort(flat, stable=True))


def _order(order: object, n: int) -> SortedIds:
    """``order`` as the SortedIds of n ids (its type and shapes; that it sorts this op's ids is
    the caller's word: checking it would read the device)."""
    if not isinstance(order, SortedIds):
        raise TypeError(f"order must be lst_kernels.SortedIds (SortedIds.of(idx)), got {type(order).__name__}")
    _tensor("order.keys", order.keys, (n,), index=True)
    _tensor("order.perm", order.perm, (n,), index=True)
    return order


def _use_triton(first: Tensor, impl: str, *others) -> bool:
    """Whether to launch the Triton kernel: all tensors on one device, then ``impl``'s choice."""
    for t in others:
        if isinstance(t, Tensor) and t.device != first.device:
            raise ValueError(f"tensors must be on one device, got {first.device} and {t.device}")
    if impl == "auto":
        return first.is_cuda and _TRITON_IMPORTABLE and os.environ.get("LST_KERNELS", "auto") != "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl == "triton"


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None, *, impl: str = "auto") -> Tensor:
    """A[j, k] = X[j] . V[idx[j, k]] + x0[j]; padding slots give 0. (m, K)."""
    d = _tensor("V", V, (None, None)).shape[1]
    m = _tensor("idx", idx, (None, None), index=True).shape[0]
    _tensor("X", X, (m, d))
    if x0 is not None:
        _tensor("x0", x0, (m,))
    if _use_triton(V, impl, idx, X, x0):
        from .gather_dot_kernel import gather_dot as launch  # noqa: PLC0415  (imports Triton)
        return launch(V, idx, X, x0)
    return reference.gather_dot(V, idx, X, x0)


def gather_sum(V: Tensor, idx: Tensor, G: Tensor, *, impl: str = "auto") -> Tensor:
    """Y[j] = sum_k G[j, k] V[idx[j, k]] (padding ignored): Yd V. (m, d)."""
    _tensor("V", V, (None, None))
    _tensor("G", G, tuple(_tensor("idx", idx, (None, None), index=True).shape))
    if _use_triton(V, impl, idx, G):
        from .gather_sum_kernel import gather_sum as launch  # noqa: PLC0415
        return launch(V, idx, G)
    return reference.gather_sum(V, idx, G)


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor, *,
                      order: SortedIds | None = None, impl: str = "auto") -> Tensor:
    """V[idx[j, k]] += alpha G[j, k] X[j] in place, repeated rows summed in batch order
    (deterministic, no float atomics); ``alpha`` may be a device scalar (CUDA graphs).
    ``order``: ``SortedIds.of(idx)`` made already (the Triton path sorts otherwise)."""
    d = _tensor("V", V, (None, None)).shape[1]
    m, K = _tensor("idx", idx, (None, None), index=True).shape
    _tensor("G", G, (m, K))
    _tensor("X", X, (m, d))
    _scalar("alpha", alpha)
    if order is not None:
        _order(order, m * K)
    if _use_triton(V, impl, idx, G, X, alpha):
        from .scatter_add_rows_kernel import scatter_add_rows_ as launch  # noqa: PLC0415
        return launch(V, idx, G, X, alpha, order)
    # The reference's sums in shapes fixed by idx (no ``torch.unique``, no boolean mask: no host
    # read, ``torch.compile`` takes it whole): the m K slots sorted stably, each run of equal ids
    # summed in batch order into one row of an (m K, d) buffer, then one ``index_add_`` into V, the
    # buffer's unused rows adding exact zeros to row 0. The reference's bits.
    ct = torch.promote_types(torch.promote_types(G.dtype, X.dtype), V.dtype)
    keys, perm = SortedIds.of(idx) if order is None else order
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    run = torch.cumsum(first, 0) - 1  # each sorted slot's run of equal ids
    contrib = G.to(ct).reshape(-1, 1) * (X.to(ct) if K == 1 else X.to(ct).repeat_interleave(K, dim=0))
    contrib = torch.where((keys >= 0)[:, None], contrib.index_select(0, perm), 0.0)  # padding adds nothing
    summed = torch.zeros(m * K, X.shape[1], dtype=ct, device=V.device).index_add_(0, run, contrib)
    rows = torch.zeros_like(keys).scatter_(0, run, keys.clamp(min=0))  # each run's row of V
    return V.index_add_(0, rows, (alpha * summed).to(V.dtype))


def fold_rows_(V: Tensor, M: Tensor, flag: Tensor | bool, *, impl: str = "auto") -> Tensor:
    """V <- V M in place where ``flag`` (a bool or a one-element tensor) is true, else nothing;
    returns V. The flag is read on the device: a step under device flags folds a nearly
    singular update into V with no host read (the Triton kernel on CUDA; the CPU's
    implementation reads its CPU flag, where nothing waits: ``_fold_rows_gated``). O(D d^2)
    where the flag is set; one load a program where it is not."""
    d = _tensor("V", V, (None, None)).shape[1]
    _tensor("M", M, (d, d))
    if isinstance(flag, bool):
        flag = torch.tensor(flag, device=V.device)
    elif not isinstance(flag, Tensor) or flag.numel() != 1 or flag.is_floating_point():
        raise TypeError(f"flag must be a bool or a one-element bool or integer tensor, got {flag!r}")
    if _use_triton(V, impl, M, flag) and V.stride(1) == 1:
        from .fold_rows_kernel import fold_rows_ as launch  # noqa: PLC0415
        return launch(V, M, flag)
    if torch.compiler.is_compiling():
        _fold_rows_op(V, M, flag)  # one opaque op of the compiled graph
    else:
        _fold_rows_gated(V, M, flag)  # eager: the same function, without the custom op's dispatch
    return V


#: bytes of V's rows a block of an in-place pass over V on the CPU (the rows the write finds in
#: cache): the gated fold's here, and the head's folds and fixes (lst_lightning.spherical.blocks)
CACHE_BYTES = 2 << 20


def _fold_rows_gated(V: Tensor, M: Tensor, flag: Tensor) -> None:
    """``fold_rows_``'s plain-torch implementation. It reads the flag: on the CPU a load of a CPU
    value, where nothing waits (on CUDA without Triton, a synchronisation). The fold runs over
    cache-sized blocks of rows and never holds a D x d temporary."""
    if not bool(flag):
        return
    M = M.to(V.dtype)
    rows = max(1, CACHE_BYTES // max(1, V.shape[1] * V.element_size()))
    for a in range(0, V.shape[0], rows):
        blk = V[a:a + rows]
        blk.copy_(blk @ M)


@torch.library.custom_op("lst_kernels::fold_rows_", mutates_args=("V",))
def _fold_rows_op(V: Tensor, M: Tensor, flag: Tensor) -> None:
    """``_fold_rows_gated`` as a ``torch.library`` custom op: one opaque call that mutates V in a compiled
    step (no graph break, no copy of V)."""
    _fold_rows_gated(V, M, flag)


@_fold_rows_op.register_fake
def _(V: Tensor, M: Tensor, flag: Tensor) -> None:
    return None


def sparse_gram(idx: Tensor, G: Tensor, *, impl: str = "auto") -> Tensor:
    """The m x m Yd Yd^T: sum over k, l of G[i, k] G[j, l] [idx[i, k] == idx[j, l] != -1]."""
    _tensor("G", G, tuple(_tensor("idx", idx, (None, None), index=True).shape))
    if _use_triton(idx, impl, G):
        from .sparse_gram_kernel import sparse_gram as launch  # noqa: PLC0415
        return launch(idx, G)
    return reference.sparse_gram(idx, G)


def gram_rows(idx: Tensor, G: Tensor, X: Tensor, *, order: SortedIds | None = None, impl: str = "auto") -> Tensor:
    """Yd Yd^T X (m, d) in O(m K d) plus a sort of the m K ids (``order``: made already), never
    the m x m Yd Yd^T: the slots coalesced to their distinct columns (static shapes: no host
    sync, CUDA graphs capture it), N = Yd^T X on them, then Yd N."""
    m, K = _tensor("idx", idx, (None, None), index=True).shape
    _tensor("G", G, (m, K))
    d = _tensor("X", X, (m, None)).shape[1]
    ids, perm = SortedIds.of(idx) if order is None else _order(order, m * K)
    ct = torch.promote_types(G.dtype, X.dtype)
    flat = idx.reshape(-1)
    g = torch.where(flat >= 0, G.reshape(-1).to(ct), torch.zeros((), dtype=ct, device=G.device))  # padding: 0
    first = torch.ones_like(ids)
    first[1:] = ids[1:] != ids[:-1]
    col_sorted = torch.cumsum(first, 0) - 1  # each slot's column among the distinct ones (< m K), in id order
    col = torch.empty_like(col_sorted)
    col[perm] = col_sorted
    col, g = col.view(m, K), g.view(m, K)
    N = torch.zeros(m * K, d, dtype=ct, device=X.device)
    if _use_triton(X, impl, idx, G):  # the deterministic kernels (no float atomics)
        # col is the ids relabelled in their order: the ids' stable sort is col's, no second sort
        scatter_add_rows_(N, col, g, X.to(ct), 1.0, order=SortedIds(col_sorted, perm), impl="triton")
        return gather_sum(N, col, g, impl="triton")
    Xk = X.to(ct) if K == 1 else X.to(ct).repeat_interleave(K, dim=0)  # each slot's row of X
    N.index_add_(0, col.reshape(-1), g.reshape(-1, 1) * Xk)  # sequential on CPU
    out = g.reshape(-1, 1) * N.index_select(0, col.reshape(-1))
    return out if K == 1 else out.view(m, K, d).sum(1)


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor, *, impl: str = "auto") -> Tensor:
    """M = dO dO^T (m x m) from its factors: ``Hq = H Q``, ``Z = (g_s 1^T + Yd) W``,
    ``ybar = rowsum(G_A)``, ``yy = Yd Yd^T``, ``num_classes = D``."""
    m, d = _tensor("H", H, (None, None)).shape
    _tensor("Hq", Hq, (m, d))
    _tensor("Z", Z, (m, d))
    _tensor("gq", gq, (m,))
    _tensor("gs", gs, (m,))
    _tensor("ybar", ybar, (m,))
    _tensor("yy", yy, (m, m))
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if _use_triton(H, impl, Hq, Z, gq, gs, ybar, yy):
        from .bookkeeping_kernels import m_matrix as launch  # noqa: PLC0415
        return launch(Hq, H, Z, gq, gs, ybar, num_classes, yy)
    # Two m x m x d GEMMs: with P = 2 diag(g_q) H and dH = 2 diag(g_q) Hq + Z, the four
    # H-terms of M are dH P^T + P Z^T.
    ct = torch.promote_types(torch.promote_types(H.dtype, Hq.dtype), Z.dtype)
    gq, gs, ybar = gq.to(ct), gs.to(ct), ybar.to(ct)
    P = 2.0 * gq[:, None] * H.to(ct)
    Z = Z.to(ct)
    M = torch.addcmul(Z, gq[:, None], Hq.to(ct), value=2.0) @ P.T
    M.addmm_(P, Z.T)
    M += num_classes * torch.outer(gs, gs) + torch.outer(gs, ybar) + torch.outer(ybar, gs) + yy.to(ct)
    return M


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor, *,
             impl: str = "auto") -> Tensor:
    """Q_new = c^2 Q - c lr (dH^T H + H^T dH) + lr^2 H^T M H, a new (d, d) tensor: W_new^T W_new
    for W_new = c W - lr dO^T H when Q = W^T W, dH = dO W and M = dO dO^T (symmetric)."""
    m, d = _tensor("H", H, (None, None)).shape
    _tensor("Q", Q, (d, d))
    _tensor("dH", dH, (m, d))
    _tensor("M", M, (m, m))
    _scalar("lr", lr)
    _scalar("c", c)
    if _use_triton(Q, impl, H, dH, M, lr, c):
        from .bookkeeping_kernels import q_update as launch  # noqa: PLC0415
        return launch(Q, H, dH, M, lr, c)
    # Two GEMMs: with R = (lr^2 / 2) M H - c lr dH it is c^2 Q + H^T R + (H^T R)^T.
    H = H.to(Q.dtype)
    R = 0.5 * lr * lr * (M.to(Q.dtype) @ H) - c * lr * dH.to(Q.dtype)
    HtR = H.T @ R
    return c * c * Q + HtR + HtR.T


def q_update_factors(Q: Tensor, H: Tensor, gq: Tensor, Z: Tensor, gs: Tensor, ybar: Tensor, num_classes: int,
                     YYH: Tensor, lr: float | Tensor, c: float | Tensor, *, P: Tensor | None = None,
                     Gq: Tensor | None = None, HYYH: Tensor | None = None, GqP: Tensor | None = None,
                     impl: str = "auto") -> Tensor:
    """``q_update`` without the m x m M: Q_new from d x d products of the step's factors,
    ``Z = (g_s 1^T + Yd) W`` and ``YYH = Yd Yd^T H`` (``gram_rows``). 3 m d^2 + 2 d^3
    multiply-adds (4 d^3 with ``P``; one m d^2 fewer with ``Gq``) against 3 m^2 d + m d^2 for
    ``m_matrix`` and ``q_update``: the cheaper route from m ~ d. ``P`` (d, d), symmetric: the step W_new = c W - lr dO^T H P
    (a right preconditioner), Q_new = c^2 Q - c lr (P E + E^T P) + lr^2 P H^T M H P with
    E = H^T dH; None: P = I. ``Gq`` (d, d): G = H^T diag(g_q) H made already (the step forms it
    once: m d^2 fewer here), else made here. ``HYYH`` (d, d): a further part of H^T Yd Yd^T H
    given whole (the shared negatives' block, N^T N), added to H^T YYH. ``GqP``: G P made already
    (with ``P``: d^3 fewer), an argument of this fused form only. torch on every device (``impl``
    is checked, no kernel of its own)."""
    m, d = _tensor("H", H, (None, None)).shape
    _tensor("Q", Q, (d, d))
    for name, t in (("Z", Z), ("YYH", YYH)):
        _tensor(name, t, (m, d))
    for name, t in (("gq", gq), ("gs", gs), ("ybar", ybar)):
        _tensor(name, t, (m,))
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    _scalar("lr", lr)
    _scalar("c", c)
    for name, t in (("P", P), ("Gq", Gq), ("GqP", GqP), ("HYYH", HYYH)):
        if t is not None:
            _tensor(name, t, (d, d))
    _use_triton(Q, impl, H, gq, Z, gs, ybar, YYH, P, Gq, GqP, HYYH)
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


def logsumexp_rows(Z: Tensor, *, with_softmax: bool = False, impl: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """log sum_j exp(Z[i, j]) per row of a floating (m, n) Z, n >= 1: (m, 1), differentiable,
    -inf entries (masked slots) taking no mass. The sampled softmaxes' normaliser (the exact
    head's ``loss="sampled"``, the sampled softmax baseline, the hierarchical softmax's
    row-sparse training). Not ``torch.logsumexp``: on the CPU its exp, and its gradient's
    ``exp(Z - lse)``, take a slow path for every shifted entry below about -87 (float32's
    smallest normal), 12x at 256 x 65 once a model's outputs spread that far
    (docs/kernels.md); the softmax kernel does not.
    ``with_softmax``: (the normaliser, softmax(Z)) outside autograd, for a loss whose
    gradient is written in closed form. torch on every device (``impl`` is checked, no
    kernel of its own)."""
    if not isinstance(Z, Tensor):
        raise TypeError(f"Z must be a torch.Tensor, got {type(Z).__name__}")
    if not Z.is_floating_point() or Z.dim() != 2 or Z.shape[1] < 1:
        raise ValueError(f"Z must be a floating (m, n) tensor with n >= 1, got {Z.dtype} {tuple(Z.shape)}")
    _use_triton(Z, impl)
    if not with_softmax:
        return _LogSumExpRows.apply(Z)
    with torch.no_grad():  # the row max and the softmax p; p at the max is 1 / sum exp(Z - max)
        top, arg = Z.max(1, keepdim=True)
        p = torch.softmax(Z, 1)
        return top - p.gather(1, arg).log(), p
