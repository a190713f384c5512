"""V in blocks of rows: the rare O(D d^2) passes over V (folds, singular-value fixes,
bookkeeping refreshes, materialising W, scoring) never hold a D x d temporary."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lst_kernels.torch_ops import CACHE_BYTES

BLOCK = 1 << 16  # rows per block; also the unit in which the initial V is drawn
# CACHE_BYTES, a block of an in-place pass over V on the CPU (a fold, a singular-value fix; the
# gated fold's too: one constant, in lst_kernels): small enough that the write finds the rows the
# read brought into cache (a rank-3 fix at D = 10^6, d = 128, one thread: 266 ms in blocks of
# 2^16 rows, 43 ms in 2 MiB blocks; a fold 550 -> 359 ms)


def row_blocks(X: Tensor, size: int = BLOCK) -> Iterator[tuple[int, Tensor]]:
    """(first row, view of rows [first, first + size)) over X's rows; in-place writes reach X."""
    for a in range(0, X.shape[0], size):
        yield a, X[a:a + size]


def in_place_blocks(X: Tensor) -> Iterator[tuple[int, Tensor]]:
    """``row_blocks`` for a pass that reads X's rows and writes them back: CACHE_BYTES of rows
    a block on the CPU, BLOCK rows on a GPU (one launch a block)."""
    rows = BLOCK if X.is_cuda else max(1, CACHE_BYTES // max(1, X.shape[1] * X.element_size()))
    return row_blocks(X, rows)


@torch.no_grad()
def weight_of(V: Tensor, U: Tensor, omega: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The implicit W = V U + 1 omega^T, formed in blocks of V's rows (``head.weight()``, and a
    patched HF model's saved dense ``lm_head``: the same bits from the same factors) on U's device,
    stored on V's (a V gathered on the host: W there, each block made on the head's device);
    ``dtype``: W stored in it, each block rounded once made (no D x d temporary in V's dtype)."""
    W = torch.empty(V.shape, dtype=V.dtype if dtype is None else dtype, device=V.device)
    for a, blk in row_blocks(V):
        rows = W[a:a + blk.shape[0]]
        if W.dtype == V.dtype and V.device == U.device:
            torch.addmm(omega, blk, U, out=rows)
        else:
            rows.copy_(torch.addmm(omega, blk.to(U.device), U))
    return W
