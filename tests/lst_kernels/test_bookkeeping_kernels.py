"""The Triton M = dO dO^T and Q update against their references; outputs exactly symmetric."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import FLOAT_DTYPES, KERNEL_DEVICES, SHAPES, TILED_SHAPE, bookkeeping_inputs, close, dtypes_id

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.bookkeeping_kernels import m_matrix, q_update  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtypes", FLOAT_DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_triton_m_matrix(shape, dtypes, device):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, device, dtypes)
    args = (s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    M = m_matrix(*args)
    assert torch.equal(M, M.T)
    close(M, ref.m_matrix(*args), rtol=2e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtypes", FLOAT_DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("shape", SHAPES + [(5, 1, 6, 70)])  # d = 70: more than one tile
def test_triton_q_update(shape, dtypes, device):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, device, dtypes)
    M = ref.m_matrix(s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    dH = torch.randn(m, d, device=device).to(s["Q"].dtype)
    lr_t, c_t = (torch.tensor(x, device=device, dtype=s["Q"].dtype) for x in (0.05, 0.97))  # device scalars
    for lr, c in ((0.05, 1.0), (0.05, 0.97), (lr_t, c_t)):
        Q_new = q_update(s["Q"], s["H"], dH, M, lr, c)
        assert torch.equal(Q_new, Q_new.T)
        close(Q_new, ref.q_update(s["Q"], s["H"], dH, M, lr, c), rtol=2e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_q_update_keeps_float64_q_unrounded(device):
    """c^2 Q in float64 for a float64 Q (c a host float or a device scalar): Q's values are never
    rounded to float32; only the products H^T P are float32."""
    m, d = 3, 37
    A = torch.randn(d, d, dtype=torch.float64, device=device)
    Q = A + A.T + 1e-12  # exactly symmetric
    zero = torch.zeros(m, d, dtype=torch.float64, device=device)
    M = torch.zeros(m, m, dtype=torch.float64, device=device)
    c = 1.0 - 1e-9  # not a float32
    for cc in (c, torch.tensor(c, dtype=torch.float64, device=device)):
        want = ref.q_update(Q, zero, zero, M, 0.1, cc)
        assert ((q_update(Q, zero, zero, M, 0.1, cc) - want).abs() / want.abs()).max() < 1e-14  # float32's: 1e-8
