"""Validation of per-class frequency counts (ids sorted by decreasing frequency)."""
from __future__ import annotations

import torch
from torch import Tensor


def check_class_counts(class_counts, num_classes: int) -> Tensor:
    """A float64 copy of the counts after checking shape and values."""
    if not isinstance(class_counts, Tensor):
        class_counts = torch.as_tensor(class_counts)
    if class_counts.shape != (num_classes,):
        raise ValueError(f"class_counts must have shape ({num_classes},), got {tuple(class_counts.shape)}")
    counts = class_counts.detach().to("cpu", torch.float64)
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("class_counts must be finite and non-negative")
    if counts.sum() <= 0:
        raise ValueError("class_counts must not all be zero")
    return counts
