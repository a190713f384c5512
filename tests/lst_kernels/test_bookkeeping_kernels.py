"""The Triton M = dO dO^T and Q update against their references; outputs exactly symmetric."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import KERNEL_DEVICES, SHAPES, TILED_SHAPE, X_DTYPES, bookkeeping_inputs, close

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.bookkeeping_kernels import m_matrix, q_update  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("h_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_triton_m_matrix(shape, h_dtype, device):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, device, h_dtype)
    args = (s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    M = m_matrix(*args)
    assert torch.equal(M, M.T)
    close(M, ref.m_matrix(*args), rtol=2e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("h_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(5, 1, 6, 70)])  # d = 70: more than one tile
def test_triton_q_update(shape, h_dtype, device):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, device, h_dtype)
    M = ref.m_matrix(s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    dH = torch.randn(m, d, device=device)
    for lr, c in ((0.05, 1.0), (0.05, 0.97), (torch.tensor(0.05, device=device), torch.tensor(0.97, device=device))):
        Q_new = q_update(s["Q"], s["H"], dH, M, lr, c)
        assert torch.equal(Q_new, Q_new.T)
        close(Q_new, ref.q_update(s["Q"], s["H"], dH, M, lr, c), rtol=2e-5)
