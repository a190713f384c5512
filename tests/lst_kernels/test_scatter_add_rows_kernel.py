"""The Triton deterministic scatter against its reference, and its bits across repeats."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, KERNEL_DEVICES, SHAPES, close, dtypes_id, make_case

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.scatter_add_rows_kernel import scatter_add_rows_  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtypes_id)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_scatter_add_rows(shape, dtypes, device):
    V, idx, G, X = make_case(*shape, device, dtypes)
    V_tri, V_ref = V.clone(), V.clone()
    out = scatter_add_rows_(V_tri, idx, G, X, 0.3)
    ref.scatter_add_rows_(V_ref, idx, G, X, 0.3)
    assert out is V_tri
    close(V_tri, V_ref)
    untouched = torch.ones(V.shape[0], dtype=torch.bool, device=device)
    untouched[idx[idx >= 0]] = False
    assert torch.equal(V_tri[untouched], V[untouched])  # rows not targeted keep their bits


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_scatter_is_deterministic_with_repeated_rows(device):
    m, K, D, d = 12, 2, 3, 133  # 24 slots on 3 rows: long runs of the same row
    V, idx, G, X = make_case(m, K, D, d, device)
    runs = []
    for _ in range(3):
        W = V.clone()
        scatter_add_rows_(W, idx, G, X, 0.01)
        runs.append(W)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    close(runs[0], ref.scatter_add_rows_(V.clone(), idx, G, X, 0.01))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_scatter_alpha_on_device(device):
    V, idx, G, X = make_case(5, 2, 4, 37, device)
    a, b = V.clone(), V.clone()
    scatter_add_rows_(a, idx, G, X, torch.tensor(-0.25, device=device))
    scatter_add_rows_(b, idx, G, X, -0.25)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_scatter_keeps_float64_rows_unrounded(device):
    """A float64 V's targeted rows keep their float64 values: only the added sum is float32."""
    V, idx, G, X = make_case(4, 2, 5, 37, device, (torch.float64, torch.float64, torch.int64))
    V = V + 1e-12  # values float32 cannot hold
    W = scatter_add_rows_(V.clone(), idx, G, X, 0.0)  # adds exact zeros
    assert torch.equal(W, V)
    W = scatter_add_rows_(V.clone(), idx, G, X, 0.3)
    assert (W - ref.scatter_add_rows_(V.clone(), idx, G, X, 0.3)).abs().max() < 1e-5  # the sums' float32 accuracy
