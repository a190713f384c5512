"""The Triton gather-dot against its reference."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, KERNEL_DEVICES, SHAPES, close, dtypes_id, make_case

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.gather_dot_kernel import gather_dot  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_gather_dot(shape, dtypes, device):
    m, K, D, d = shape
    V, idx, _, X = make_case(m, K, D, d, device, dtypes)
    x0 = torch.randn(m, device=device).to(X.dtype)
    for args in ((V, idx, X, x0), (V, idx, X)):
        A = gather_dot(*args)
        assert A.dtype == (torch.float64 if V.dtype == torch.float64 else torch.float32)
        close(A, ref.gather_dot(*args))
        assert (A[idx < 0] == 0).all()
