"""The Triton sparse Gram matrix against its reference."""
from __future__ import annotations

import pytest
from kernel_cases import KERNEL_DEVICES, SHAPES, TILED_SHAPE, close, make_case

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.sparse_gram_kernel import sparse_gram  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_triton_sparse_gram(shape, device):
    _, idx, G, _ = make_case(*shape, device)
    close(sparse_gram(idx, G), ref.sparse_gram(idx, G))
