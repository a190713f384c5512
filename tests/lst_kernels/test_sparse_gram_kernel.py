"""The Triton sparse Gram matrix against its reference."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, KERNEL_DEVICES, SHAPES, TILED_SHAPE, close, dtypes_id, make_case

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels.sparse_gram_kernel import sparse_gram  # noqa: E402


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtypes", [t for t in DTYPES if t[1] != torch.bfloat16], ids=dtypes_id)  # G: the state's
@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_triton_sparse_gram(shape, dtypes, device):
    _, idx, G, _ = make_case(*shape, device, dtypes)
    close(sparse_gram(idx, G), ref.sparse_gram(idx, G))
