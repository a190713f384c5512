"""The shared cases hold what every kernel must be checked on: K > 1 targets, padding,
classes repeated within a row and across the batch."""
from __future__ import annotations

import pytest
import torch

from lst_kernels._launch import MAX_BLOCK_K

from kernel_cases import DTYPES, SHAPES, TILED_SHAPE, make_idx


def rows_per_class(idx: torch.Tensor) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for j, row in enumerate(idx.tolist()):
        for c in row:
            if c >= 0:
                rows.setdefault(c, []).append(j)
    return rows


@pytest.mark.parametrize("ids", sorted({t[2] for t in DTYPES}, key=str))
@pytest.mark.parametrize("shape", [s for s in SHAPES + [TILED_SHAPE] if s[0] > 2 and s[1] > 1])
def test_make_idx_has_padding_and_repeats(shape, ids):
    m, K, D, _ = shape
    idx = make_idx(m, K, D, "cpu", ids)
    assert idx.dtype == ids and ((idx >= -1) & (idx < D)).all()
    assert (idx[:-1] < 0).any(), "a padding slot in a row with targets"
    assert (idx[-1] < 0).all(), "an all-padding row"
    rows = rows_per_class(idx)
    assert any(len(r) > len(set(r)) for r in rows.values()), "a class twice in one row"
    assert any(len(set(r)) > 1 for r in rows.values()), "a class in two rows"


def test_kernel_tests_use_shapes_with_k_above_one_and_several_rows():
    assert any(m > 2 and K > 1 for m, K, _, _ in SHAPES)
    # per-row negatives as slots: more slots a row than one program or pass takes
    assert any(m > 2 and K > MAX_BLOCK_K for m, K, _, _ in SHAPES)
