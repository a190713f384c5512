"""``RowAdam``: Adam over exactly the rows a step gathered (lazy Adam, torch's ``SparseAdam``
arithmetic), in static shapes.

``SparseAdam`` takes a sparse COO gradient and coalesces it, a size that changes each step, so
neither ``torch.compile`` nor a CUDA graph can take it. Here a table's gradient is its
``RowGrad``'s ids and rows (gathered.py): the repeated ids are summed by a sort of fixed size
(``coalesce_rows``), each distinct row's moments and value are read, updated as ``SparseAdam``
updates them, and written back; the slots no id fills repeat the last distinct row, so that every
write of a row writes the same numbers. The other rows keep their values and moments; bias
correction counts the table's steps (its ``step``, a device scalar: no host read). Equal to
``SparseAdam`` on the same rows (tests/rows/test_adam.py). No weight decay and no momentum on the
other rows: both would touch all D rows every step.

``compiled=True`` runs each table's update through ``torch.compile`` (``mode``: its mode), the lr
a device scalar (a new lr is no recompile). In a mode with CUDA graphs (``reduce-overhead``) beside
a model compiled in one, mark each training step's start with
``torch.compiler.cudagraph_mark_step_begin()`` (lst-train does): unmarked, the update starts a
generation of CUDA graph trees, which frees the row ids and gradients that it reads.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .coalesce import coalesce_rows
from .row_optimizer import RowOptimizer, compiled_update


def row_adam_(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, ids: Tensor, grads: Tensor,
              lr: float | Tensor, beta1: float, beta2: float, eps: float) -> None:
    """One Adam step of the rows ``ids`` (n,) of ``param`` with their gradients ``grads`` (n, ...),
    repeated ids summed, -1 ignored; ``step`` (float64, one element) counts it."""
    uids, g = coalesce_rows(ids, grads.to(param.dtype))
    n = uids.shape[0]
    valid = uids >= 0
    slots = torch.arange(n, device=uids.device)
    last = torch.where(valid, slots, 0).amax()  # the last distinct row (0 when there is none)
    src = torch.where(valid, slots, last)  # the unused slots repeat it: one value per row written
    rows = uids.index_select(0, src).clamp(min=0)
    live = valid.index_select(0, src).view(n, *[1] * (g.dim() - 1))
    g = g.index_select(0, src)
    t = step + 1
    step_size = lr * (1 - beta2 ** t).sqrt() / (1 - beta1 ** t)
    m0, v0, p0 = exp_avg.index_select(0, rows), exp_avg_sq.index_select(0, rows), param.index_select(0, rows)
    # SparseAdam's operations in its order: old += (1 - b) (new - old); numer and denom from them
    dm = (g - m0) * (1 - beta1)
    dv = (g * g - v0) * (1 - beta2)
    numer = dm + m0
    denom = (dv + v0).sqrt() + eps
    p1 = p0 + (-step_size).to(p0.dtype) * (numer / denom)
    param.index_copy_(0, rows, torch.where(live, p1, p0))
    exp_avg.index_copy_(0, rows, torch.where(live, numer, m0))
    exp_avg_sq.index_copy_(0, rows, torch.where(live, dv + v0, v0))
    step.copy_(t)


_compiled: dict = {}  # the compiled update, by mode


class RowAdam(RowOptimizer):
    """Adam on the rows of tables with static rows (``static_rows``: each parameter has a
    ``RowGrad``); ``lr``, ``betas``, ``eps`` as ``torch.optim.SparseAdam``'s."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 compiled: bool = False, mode: str | None = None):
        if not eps > 0:
            raise ValueError(f"RowAdam: eps must be > 0, got {eps}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"RowAdam: betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps}, compiled, mode)

    def _update(self):
        return compiled_update(_compiled, row_adam_, self.mode) if self.compiled else row_adam_

    def _step_table(self, update, p: Tensor, group: dict, ids: Tensor, grads: Tensor) -> None:
        state = self.state[p]
        if len(state) == 0:
            # (1,), not 0-dim: Dynamo's aot_eager drops in-place writes to a 0-dim float64 input
            state["step"] = torch.zeros(1, dtype=torch.float64, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.compiled:
                for t in (state["step"], state["exp_avg"], state["exp_avg_sq"]):
                    torch._dynamo.mark_static_address(t)
        elif state["step"].device != p.device:  # a checkpoint loaded on the host
            state["step"] = state["step"].to(p.device)
        beta1, beta2 = group["betas"]
        update(p, state["exp_avg"], state["exp_avg_sq"], state["step"], ids, grads,
               self._lr_on(group["lr"], p.device), beta1, beta2, group["eps"])
