"""Argument checks of the ops, applied once per call by the table (ops.py) before any implementation.

The kernels read raw memory, so shapes and dtypes are checked before any
launch; a bad call raises TypeError/ValueError and touches nothing. Index
values are not range-checked here (that needs a host sync): padding is -1 and
the Triton kernels skip any index outside [0, D).
"""
from __future__ import annotations

import torch
from torch import Tensor

_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _floating(name: str, t: object, shape: tuple[int, ...]) -> Tensor:
    t = _tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t


def _same_device(**tensors: Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def _index(idx: object) -> tuple[int, int]:
    idx = _tensor("idx", idx)
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"idx must be int64 or int32 (-1 for padding), got {idx.dtype}")
    if idx.dim() != 2:
        raise ValueError(f"idx must be 2-D (m, K), got shape {tuple(idx.shape)}")
    return idx.shape[0], idx.shape[1]


def _table(V: object) -> tuple[int, int]:
    V = _tensor("V", V)
    if not V.is_floating_point():
        raise TypeError(f"V must be a floating-point tensor, got {V.dtype}")
    if V.dim() != 2:
        raise ValueError(f"V must be 2-D (D, d), got shape {tuple(V.shape)}")
    return V.shape[0], V.shape[1]


def _hidden(H: object) -> tuple[int, int]:
    H = _tensor("H", H)
    if H.dim() != 2:
        raise ValueError(f"H must be 2-D (m, d), got shape {tuple(H.shape)}")
    _floating("H", H, tuple(H.shape))
    return H.shape[0], H.shape[1]


def _scalar(name: str, x: object) -> None:
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(x.shape)}")
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(x).__name__}")


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None) -> None:
    _, d = _table(V)
    m, _ = _index(idx)
    _floating("X", X, (m, d))
    if x0 is not None:
        _floating("x0", x0, (m,))
    _same_device(V=V, idx=idx, X=X, x0=x0)


def gather_sum(V: Tensor, idx: Tensor, G: Tensor) -> None:
    _table(V)
    m, K = _index(idx)
    _floating("G", G, (m, K))
    _same_device(V=V, idx=idx, G=G)


def scatter_add_rows(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor) -> None:
    _, d = _table(V)
    m, K = _index(idx)
    _floating("G", G, (m, K))
    _floating("X", X, (m, d))
    _scalar("alpha", alpha)
    _same_device(V=V, idx=idx, G=G, X=X, alpha=alpha if isinstance(alpha, Tensor) else None)


def sparse_gram(idx: Tensor, G: Tensor) -> None:
    m, K = _index(idx)
    _floating("G", G, (m, K))
    _same_device(idx=idx, G=G)


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor) -> None:
    m, d = _hidden(H)
    _floating("Hq", Hq, (m, d))
    _floating("Z", Z, (m, d))
    for name, v in (("gq", gq), ("gs", gs), ("ybar", ybar)):
        _floating(name, v, (m,))
    _floating("yy", yy, (m, m))
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    _same_device(Hq=Hq, H=H, Z=Z, gq=gq, gs=gs, ybar=ybar, yy=yy)


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor) -> None:
    m, d = _hidden(H)
    _floating("Q", Q, (d, d))
    _floating("dH", dH, (m, d))
    _floating("M", M, (m, m))
    _scalar("lr", lr)
    _scalar("c", c)
    _same_device(Q=Q, H=H, dH=dH, M=M, **{n: x for n, x in (("lr", lr), ("c", c)) if isinstance(x, Tensor)})
