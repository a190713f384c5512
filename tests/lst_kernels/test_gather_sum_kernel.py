"""The Triton gather-sum against its reference."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, KERNEL_DEVICES, SHAPES, close, dtypes_id, make_case

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.gather_sum_kernel import gather_sum  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_gather_sum(shape, dtypes, device):
    V, idx, G, X = make_case(*shape, device, dtypes)
    G = G.to(X.dtype)  # loss gradients: bf16 too
    G[idx < 0] = float("nan")  # padding slots must not be read
    Y = gather_sum(V, idx, G)
    assert torch.isfinite(Y).all()
    close(Y, ref.gather_sum(V, idx, G))
