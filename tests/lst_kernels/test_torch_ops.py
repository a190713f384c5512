"""The plain-torch bookkeeping used off CUDA against the term-by-term references."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import SHAPES, TILED_SHAPE, bookkeeping_inputs, close

from lst_kernels import reference as ref
from lst_kernels import torch_ops


@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_torch_ops_bookkeeping_match_reference(shape):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, "cpu")
    args = (s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    M = torch_ops.m_matrix(*args)
    close(M, ref.m_matrix(*args), rtol=2e-5)
    dH = torch.randn(m, d)
    for lr, c in ((0.05, 1.0), (0.05, 0.97)):
        close(torch_ops.q_update(s["Q"], s["H"], dH, M, lr, c), ref.q_update(s["Q"], s["H"], dH, M, lr, c),
              rtol=2e-5)
