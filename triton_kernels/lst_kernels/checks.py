"""The argument checks of the public ops (``functional.py``, ``SortedIds.of``): bad input raises
TypeError/ValueError before anything runs or changes. The implementations (``ops.py``) check
nothing."""
from __future__ import annotations

import torch
from torch import Tensor

INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, t: object, shape: tuple, index: bool = False) -> Tensor:
    """``t`` as a tensor of ``shape`` (None: any size), floating, or int32/int64 with ``index``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if index and t.dtype not in INDEX_DTYPES:
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


def scalar(name: str, x: object) -> None:
    """A real number: an int or float, or a one-element real tensor."""
    if isinstance(x, Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(x.shape)}")
        if x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a {x.dtype} tensor")
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(x).__name__}")


def written(name: str, t: Tensor) -> None:
    """``t`` may be written in place: not a leaf that requires grad (torch refuses such a write
    itself on one implementation, a kernel would not)."""
    if t.requires_grad and t.is_leaf:
        raise RuntimeError(f"{name} is a leaf that requires grad: an in-place op would write it behind "
                           "autograd's back (pass it detached, or inside torch.no_grad())")


def positive_int(name: str, x: object) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
