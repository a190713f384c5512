"""Bad input raises before anything runs, in the public ops and the Triton ops alike: both are
made from the table of ops (ops.py), which checks every call first."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import KERNEL_DEVICES, make_case

import lst_kernels

pytest.importorskip("triton")
from lst_kernels import triton_ops as tri  # noqa: E402

IMPLS = [pytest.param(lst_kernels, id="dispatch"), pytest.param(tri, id="triton")]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_raises_and_leaves_v_untouched(impl):
    device = KERNEL_DEVICES[0]
    V, idx, G, X = make_case(4, 2, 5, 8, device)
    before = V.clone()
    bad_calls = [
        (TypeError, lambda: impl.scatter_add_rows_(V, idx.float(), G, X, 0.1)),  # float indices
        (ValueError, lambda: impl.scatter_add_rows_(V, idx[0], G, X, 0.1)),  # 1-D idx
        (ValueError, lambda: impl.scatter_add_rows_(V, idx, G, X[:, :-1], 0.1)),  # X width != d
        (ValueError, lambda: impl.scatter_add_rows_(V, idx, G[:3], X, 0.1)),  # G rows != m
        (TypeError, lambda: impl.scatter_add_rows_(V, idx, G, X, "0.1")),
        (ValueError, lambda: impl.scatter_add_rows_(V, idx, G, X, torch.ones(2, device=device))),
        (ValueError, lambda: impl.gather_dot(V, idx, X, torch.zeros(3, device=device))),
        (TypeError, lambda: impl.gather_sum(V, idx, G.long())),
        (ValueError, lambda: impl.sparse_gram(idx[None], G)),
        (ValueError, lambda: impl.q_update(torch.eye(8, device=device), X, X, torch.eye(3, device=device), 0.1, 1.0)),
        (ValueError, lambda: impl.m_matrix(X, X, X, G[:, 0], G[:, 0], G[:, 0], 0, torch.eye(4, device=device))),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
    assert torch.equal(V, before)
