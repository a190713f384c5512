"""Small helpers shared by the Triton launchers."""
from __future__ import annotations

from torch import Tensor


def scalar_arg(x: float | Tensor) -> tuple[float | Tensor, bool]:
    """A kernel argument for a scalar that may live on the device.

    A one-element tensor is passed by pointer (read in the kernel), so a
    captured CUDA graph sees a new learning rate without recapture.
    """
    if isinstance(x, Tensor):
        return x.reshape(1), True
    return float(x), False
