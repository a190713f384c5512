"""The table of the sparse ops: each op registered once, with its argument check, its
torch reference, the torch implementation used off CUDA, and its Triton launcher.

Every public function (``lst_kernels.<op>``, ``triton_ops.<op>``) is made from this
table by ``checked``: the check runs first, so bad input raises before any launch and
touches nothing; no op has a wrapper of its own. The launchers are found by name
(``<kernel module>.<op>``) and imported only where Triton runs.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from . import checks, reference, torch_ops


@dataclass(frozen=True)
class Op:
    name: str
    check: Callable[..., None]
    reference: Callable[..., Tensor]
    #: The implementation off CUDA: the reference, or the same products in fewer GEMMs (torch_ops).
    torch: Callable[..., Tensor]
    #: The module of this package holding the Triton launcher, a function named like the op.
    kernel_module: str

    def triton(self) -> Callable[..., Tensor]:
        """The Triton launcher (imports Triton)."""
        return getattr(importlib.import_module(f"{__package__}.{self.kernel_module}"), self.name)


OPS: dict[str, Op] = {op.name: op for op in (
    Op("gather_dot", checks.gather_dot, reference.gather_dot, reference.gather_dot, "gather_dot_kernel"),
    Op("gather_sum", checks.gather_sum, reference.gather_sum, reference.gather_sum, "gather_sum_kernel"),
    Op("scatter_add_rows_", checks.scatter_add_rows, reference.scatter_add_rows_, reference.scatter_add_rows_,
       "scatter_add_rows_kernel"),
    Op("sparse_gram", checks.sparse_gram, reference.sparse_gram, reference.sparse_gram, "sparse_gram_kernel"),
    Op("m_matrix", checks.m_matrix, reference.m_matrix, torch_ops.m_matrix, "bookkeeping_kernels"),
    Op("q_update", checks.q_update, reference.q_update, torch_ops.q_update, "bookkeeping_kernels"),
)}


def checked(op: Op, pick: Callable[[Tensor], Callable[..., Tensor]]) -> Callable[..., Tensor]:
    """``op`` as a public function: its check, then the implementation ``pick`` chooses for
    the first argument's tensor (whose device the check has made every argument's)."""
    @functools.wraps(op.reference)
    def call(*args, **kwargs):
        op.check(*args, **kwargs)
        return pick(args[0])(*args, **kwargs)
    return call
