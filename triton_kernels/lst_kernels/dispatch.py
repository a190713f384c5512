"""The public ops, made from the table (ops.py): Triton on CUDA tensors when Triton is
importable, the torch implementation elsewhere (or everywhere with ``LST_KERNELS=torch``)."""
from __future__ import annotations

import os

from torch import Tensor

from .ops import OPS, Op, checked

_TRITON_OK: bool | None = None


def _triton_ok() -> bool:
    """Whether the Triton launchers can be imported here (once)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401, PLC0415
            _TRITON_OK = True
        except ImportError:
            _TRITON_OK = False
    return _TRITON_OK


def _chooser(op: Op):
    launcher = None

    def pick(t: Tensor):
        nonlocal launcher
        if t.is_cuda and os.environ.get("LST_KERNELS", "auto") != "torch" and _triton_ok():
            if launcher is None:
                launcher = op.triton()
            return launcher
        return op.torch
    return pick


gather_dot = checked(OPS["gather_dot"], _chooser(OPS["gather_dot"]))
gather_sum = checked(OPS["gather_sum"], _chooser(OPS["gather_sum"]))
scatter_add_rows_ = checked(OPS["scatter_add_rows_"], _chooser(OPS["scatter_add_rows_"]))
sparse_gram = checked(OPS["sparse_gram"], _chooser(OPS["sparse_gram"]))
m_matrix = checked(OPS["m_matrix"], _chooser(OPS["m_matrix"]))
q_update = checked(OPS["q_update"], _chooser(OPS["q_update"]))
