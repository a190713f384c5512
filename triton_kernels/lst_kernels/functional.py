"""The sparse ops of the factored head: one public function per op.

Each function checks its arguments first (bad input raises TypeError/ValueError before
anything runs or changes), then picks its implementation inline: the Triton launcher of
``<op>_kernel(s).py`` for CUDA tensors when Triton is importable, the plain-torch one
otherwise. ``impl`` forces the choice ("torch", "triton"; "auto" also honours
``LST_KERNELS=torch``). The torch implementation of the four sparse ops is the reference
itself (``reference.py``); ``m_matrix`` and ``q_update`` run the same products arranged in
two GEMMs each, tested against the term-by-term references.

Index values are not range-checked here (that needs a host sync): padding is -1, and the
Triton kernels skip any index outside [0, D).

Shapes: ``V`` (D, d); ``idx`` (m, K) int64 or int32, -1 for padding; ``G`` (m, K);
``X``, ``H`` (m, d); ``Q`` (d, d); ``M`` (m, m).
"""
from __future__ import annotations

import importlib.util
import os

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
                      impl: str = "auto") -> Tensor:
    """V[idx[j, k]] += alpha G[j, k] X[j] in place, repeated rows summed in batch order
    (deterministic, no float atomics); ``alpha`` may be a device scalar (CUDA graphs)."""
    d = _tensor("V", V, (None, None)).shape[1]
    m, K = _tensor("idx", idx, (None, None), index=True).shape
    _tensor("G", G, (m, K))
    _tensor("X", X, (m, d))
    _scalar("alpha", alpha)
    if _use_triton(V, impl, idx, G, X, alpha):
        from .scatter_add_rows_kernel import scatter_add_rows_ as launch  # noqa: PLC0415
        return launch(V, idx, G, X, alpha)
    return reference.scatter_add_rows_(V, idx, G, X, alpha)


def sparse_gram(idx: Tensor, G: Tensor, *, impl: str = "auto") -> Tensor:
    """The m x m Yd Yd^T: sum over k, l of G[i, k] G[j, l] [idx[i, k] == idx[j, l] != -1]."""
    _tensor("G", G, tuple(_tensor("idx", idx, (None, None), index=True).shape))
    if _use_triton(idx, impl, G):
        from .sparse_gram_kernel import sparse_gram as launch  # noqa: PLC0415
        return launch(idx, G)
    return reference.sparse_gram(idx, G)


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
