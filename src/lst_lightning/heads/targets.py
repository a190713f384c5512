"""Input checks and target normalisation shared by the baseline heads.

Every head takes ``target_idx`` (m,) or (m, K) int64 with -1 for padding (and
``ignore_index``, -100 by default, PyTorch's convention) and an optional
``target_val`` of the same shape (default 1 on each real slot). The loss of a
softmax-type head is ``-sum_k t_k log p(idx_k | h)``, the same convention as the
normalised spherical losses, and the minibatch loss is the mean (or sum) over the m rows.

The checks that read a device value on the host (non-finite hidden states or loss, a class id
out of range) are left out while ``torch.compile`` traces a head (a host read breaks its graph):
a loop that compiles a head reads its loss for non-finite values every few steps instead
(``LanguageModel``), and an id out of range fails in the gather.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

REDUCTIONS = ("mean", "sum")
#: PyTorch's default ``ignore_index``: a padding id beside -1.
IGNORE_INDEX = -100


def check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def in_head_dtype(method):
    """A head method run on ``hidden`` in the head's dtype (its parameters') where autocast does not
    choose the products' dtype: a float32 head on a bf16 or float64 body computes in float32, as the
    factored head does (``own_math``), and ``hidden``'s gradient returns in its own dtype (torch's
    matmuls refused the mixed dtypes, or ran them in the hidden states' dtype)."""
    @functools.wraps(method)
    def wrapped(self, hidden, *args, **kwargs):
        if (isinstance(hidden, Tensor) and hidden.is_floating_point()
                and not torch.is_autocast_enabled(hidden.device.type)):
            hidden = hidden.to(next(self.parameters()).dtype)
        return method(self, hidden, *args, **kwargs)
    return wrapped


def check_hidden(hidden: Tensor, hidden_dim: int, finite: bool = True) -> None:
    """A 2-D floating ``hidden`` of ``hidden_dim`` columns; with ``finite`` (training, log_prob) no
    nan or inf (a host read: ``scores``, called chunk by chunk, leaves it out)."""
    if not isinstance(hidden, Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_dim:
        raise ValueError(f"hidden must have shape (m, {hidden_dim}), got {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if finite and not torch.compiler.is_compiling() and not torch.isfinite(hidden).all():
        raise ValueError("hidden contains non-finite values (nan or inf)")


def target_slots(target_idx: Tensor, target_val: Tensor | None, m: int, num_classes: int,
                 dtype: torch.dtype, device: torch.device | None = None,
                 finite_values: bool = True, check_range: bool = True,
                 ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor, Tensor]:
    """Validate targets for m rows; return ``idx`` (m, K) int64 (-1 on padding: -1 or ``ignore_index``),
    ``val`` (m, K) in ``dtype``, zero on padding, and ``valid`` (m, K).

    Every head calls this before touching its state. ``finite_values=False`` lets
    non-finite target values through (the self-updating heads skip such a step);
    ``check_range=False`` leaves the range check (a host sync) to the caller."""
    if not isinstance(target_idx, Tensor):
        raise TypeError(f"target_idx must be a torch.Tensor, got {type(target_idx).__name__}")
    if target_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target_idx must be an int64 (or int32) tensor, got {target_idx.dtype}")
    if device is not None and target_idx.device != device:
        raise ValueError(f"target_idx is on {target_idx.device} but the head is on {device}")
    idx = (target_idx[:, None] if target_idx.dim() == 1 else target_idx).long()
    if ignore_index != -1:
        idx = idx.masked_fill(idx == ignore_index, -1)
    if idx.dim() != 2 or idx.shape[0] != m or idx.shape[1] == 0:
        raise ValueError(f"target_idx must have shape ({m},) or ({m}, K) with K >= 1, "
                         f"got {tuple(target_idx.shape)}")
    bad = (idx < -1) | (idx >= num_classes)
    if check_range and not torch.compiler.is_compiling() and bool(bad.any()):
        raise ValueError(f"target index {int(idx[bad][0])} is outside [0, {num_classes}): class ids must be "
                         f"in [0, {num_classes}), or -1 or ignore_index ({ignore_index}) for padding")
    valid = idx >= 0
    if target_val is None:
        return idx, valid.to(dtype), valid
    if not isinstance(target_val, Tensor) or not target_val.is_floating_point():
        raise TypeError("target_val must be a floating tensor or None, got "
                        f"{target_val.dtype if isinstance(target_val, Tensor) else type(target_val).__name__}")
    if target_val.shape != target_idx.shape:
        raise ValueError(f"target_val must have the shape of target_idx {tuple(target_idx.shape)}, "
                         f"got {tuple(target_val.shape)}")
    if device is not None and target_val.device != device:
        raise ValueError(f"target_val is on {target_val.device} but the head is on {device}")
    if finite_values and not torch.compiler.is_compiling() and not torch.isfinite(target_val).all():
        raise ValueError("target_val contains non-finite values (nan or inf)")
    val = target_val.reshape(idx.shape).to(dtype)
    val = torch.where(valid, val, torch.zeros((), dtype=dtype, device=val.device))
    return idx, val, valid


def check_class_ids(target_idx: Tensor, m: int, num_classes: int, what: str = "target_rank") -> Tensor:
    """``target_idx`` (m,) or (m, 1) of class ids in [0, num_classes), flattened: a rank or a
    target score is undefined for padding, so the caller drops padded rows first."""
    if not isinstance(target_idx, Tensor) or target_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: target_idx must be an int64 (or int32) tensor, got "
                        f"{target_idx.dtype if isinstance(target_idx, Tensor) else type(target_idx).__name__}")
    if target_idx.numel() != m or (target_idx.dim() == 2 and target_idx.shape[1] != 1) or target_idx.dim() > 2:
        raise ValueError(f"{what}: target_idx must have shape ({m},) (one class per row of hidden), "
                         f"got {tuple(target_idx.shape)}")
    flat = target_idx.reshape(-1).long()
    bad = (flat < 0) | (flat >= num_classes)
    if bool(bad.any()):
        raise ValueError(f"{what}: target index {int(flat[bad][0])} is not a class id in [0, {num_classes}); "
                         "a rank is undefined for padding: drop padded rows (-1, ignore_index) first")
    return flat


def class_range(num_classes: int, start: int, end: int | None) -> int:
    """``scores``' slice of classes, ``start:end`` (None: to D), as an end: a non-empty range inside
    ``[0, D)``, never a Python slice's wrap-around or clipping."""
    end = num_classes if end is None else end
    if not 0 <= start < end <= num_classes:
        raise ValueError(f"need 0 <= start < end <= {num_classes}, got start={start}, end={end}")
    return end


def check_k(k: int, what: str = "topk") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{what}: k must be an int >= 1, got {k!r}")
    return k


def check_targets(hidden: Tensor, target_idx: Tensor, target_val: Tensor | None,
                  num_classes: int, hidden_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Validate hidden states and targets; return ``idx``, ``val`` and ``valid`` (m, K)."""
    check_hidden(hidden, hidden_dim)
    if hidden.shape[0] == 0:
        raise ValueError("hidden has no rows: the minibatch is empty")
    return target_slots(target_idx, target_val, hidden.shape[0], num_classes, hidden.dtype)


def reduce_rows(per_example: Tensor, reduction: str) -> Tensor:
    """Mean or sum over the m rows; a non-finite loss is an error, not a silent nan."""
    out = per_example.mean() if reduction == "mean" else per_example.sum()
    if not torch.compiler.is_compiling() and not torch.isfinite(out):
        raise FloatingPointError(f"non-finite loss ({out.item()}): the head's parameters or inputs diverged")
    return out


def first_occurrence(idx: Tensor) -> Tensor:
    """(m, K) bool: True on real slots whose class did not occur earlier in the same row."""
    K = idx.shape[1]
    if K == 1:  # one slot a row: every real one is a first occurrence
        return idx >= 0
    same = (idx[:, :, None] == idx[:, None, :]) & torch.ones(K, K, dtype=torch.bool, device=idx.device).tril(-1)
    return (idx >= 0) & ~same.any(2)
