"""V in blocks of rows: the rare O(D d^2) passes over V (folds, singular-value fixes,
bookkeeping refreshes, materialising W, scoring) never hold a D x d temporary."""
from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

BLOCK = 1 << 16  # rows per block; also the unit in which the initial V is drawn


def row_blocks(X: Tensor, size: int = BLOCK) -> Iterator[tuple[int, Tensor]]:
    """(first row, view of rows [first, first + size)) over X's rows; in-place writes reach X."""
    for a in range(0, X.shape[0], size):
        yield a, X[a:a + size]
