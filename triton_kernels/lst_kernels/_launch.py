"""What the Triton launchers share: the block sizes, the choice of tile, and scalar arguments."""
from __future__ import annotations

from torch import Tensor

#: Columns of d a program handles at once (gather_dot, gather_sum, scatter_add_rows_).
BLOCK_D = 128
#: Target slots a program handles at once, at most (gather_dot, gather_sum).
MAX_BLOCK_K = 16


def block_k(K: int) -> int:
    """The slots per program for K targets a row: the next power of two, 2 to MAX_BLOCK_K."""
    return max(2, min(MAX_BLOCK_K, 1 << max(0, K - 1).bit_length()))


def tile(n: int, itemsize: int) -> int:
    """The side of the square tiles of an n x n symmetric output (m_matrix, q_update): smaller
    tiles for small outputs, so that enough programs run at once; and for float64 inputs, whose
    64-wide tiles need 192 KiB of shared memory (the pipelined loads), more than an A100 has
    (163 KiB)."""
    return 64 if n >= 1024 and itemsize <= 4 else 32


def scalar_arg(x: float | Tensor) -> tuple[float | Tensor, bool]:
    """A kernel argument for a scalar that may live on the device.

    A one-element tensor is passed by pointer (read in the kernel), so a
    captured CUDA graph sees a new learning rate without recapture.
    """
    if isinstance(x, Tensor):
        return x.reshape(1), True
    return float(x), False
