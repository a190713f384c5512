"""Choose the implementation of each sparse op per call."""
from __future__ import annotations

import os

from torch import Tensor

from . import reference, torch_ops


def _use_triton(t: Tensor) -> bool:
    if os.environ.get("LST_KERNELS", "auto") == "torch":
        return False
    return t.is_cuda and _triton_ops() is not None


_TRITON = None


def _triton_ops():
    """The Triton implementations, or None when they cannot be used here."""
    global _TRITON
    if _TRITON is None:
        try:
            from . import triton_ops  # noqa: PLC0415

            _TRITON = triton_ops
        except ImportError:
            _TRITON = False
    return _TRITON or None


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None) -> Tensor:
    impl = _triton_ops() if _use_triton(V) else reference
    return impl.gather_dot(V, idx, X, x0)


def gather_sum(V: Tensor, idx: Tensor, G: Tensor) -> Tensor:
    impl = _triton_ops() if _use_triton(V) else reference
    return impl.gather_sum(V, idx, G)


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor) -> Tensor:
    impl = _triton_ops() if _use_triton(V) else reference
    return impl.scatter_add_rows_(V, idx, G, X, alpha)


def sparse_gram(idx: Tensor, G: Tensor) -> Tensor:
    impl = _triton_ops() if _use_triton(idx) else reference
    return impl.sparse_gram(idx, G)


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor) -> Tensor:
    impl = _triton_ops() if _use_triton(H) else torch_ops
    return impl.m_matrix(Hq, H, Z, gq, gs, ybar, num_classes, yy)


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor) -> Tensor:
    impl = _triton_ops() if _use_triton(Q) else torch_ops
    return impl.q_update(Q, H, dH, M, lr, c)
