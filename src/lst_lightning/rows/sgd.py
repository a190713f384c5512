"""``RowSGD``: plain SGD over exactly the rows a step gathered, in static shapes: torch's SGD on a
sparse gradient (``torch.optim.SGD`` with ``nn.Embedding(sparse=True)``), whose coalesced size
changes each step, as one ``index_add_`` of the batch's fixed size. Repeated ids sum (as a
sparse gradient's do), padding ids (-1) add nothing; the other rows keep their values. No
momentum and no weight decay: both would touch all D rows every step. Equal to torch's SGD on the
same rows (tests/rows/test_sgd.py).

``compiled=True`` runs each table's update through ``torch.compile`` (``mode``: its mode), the lr
a device scalar, as ``RowAdam`` does (adam.py says when to mark a step's start under CUDA graphs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .row_optimizer import RowOptimizer, compiled_update


def row_sgd_(param: Tensor, ids: Tensor, grads: Tensor, lr: float | Tensor) -> None:
    """``param[ids] -= lr grads`` with repeated ids summed and -1 ignored (ids (n,), grads (n, ...))."""
    real = (ids >= 0).view(-1, *[1] * (grads.dim() - 1))
    step = torch.where(real, grads.to(param.dtype), 0.0) * (-lr)
    param.index_add_(0, ids.clamp(min=0), step.to(param.dtype))


_compiled: dict = {}  # the compiled update, by mode


class RowSGD(RowOptimizer):
    """SGD on the rows of tables with static rows (``static_rows``: each parameter has a ``RowGrad``)."""

    def __init__(self, params, lr: float = 1e-2, compiled: bool = False, mode: str | None = None):
        super().__init__(params, {"lr": lr}, compiled, mode)

    def _update(self):
        return compiled_update(_compiled, row_sgd_, self.mode) if self.compiled else row_sgd_

    def _step_table(self, update, p: Tensor, group: dict, ids: Tensor, grads: Tensor) -> None:
        update(p, ids, grads, self._lr_on(group["lr"], p.device))
