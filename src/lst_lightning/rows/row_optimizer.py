"""``RowOptimizer``: what the row-sparse optimisers in static shapes share (``RowAdam``, ``RowSGD``):
every parameter a table with static rows (``static_rows``: a ``RowGrad``), each table's update
optionally through ``torch.compile`` (``compiled``, in ``mode``) with the lr as a device scalar (a
new lr is no recompile), the step over the tables that a backward reached, and ``zero_grad`` on the
tables' ``RowGrad``."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .gathered import row_grad_of


def compiled_update(cache: dict, update: Callable, mode: str | None) -> Callable:
    """``update`` through ``torch.compile`` in ``mode``, made once per mode (kept in ``cache``)."""
    fn = cache.get(mode)
    if fn is None:
        fn = cache[mode] = torch.compile(update, fullgraph=True, dynamic=False, mode=mode)
    return fn


class RowOptimizer(torch.optim.Optimizer):
    def __init__(self, params, defaults: dict, compiled: bool = False, mode: str | None = None):
        if not defaults["lr"] > 0:
            raise ValueError(f"{type(self).__name__}: lr must be > 0, got {defaults['lr']}")
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if row_grad_of(p) is None:
                    raise ValueError(f"{type(self).__name__} steps tables with static rows (rows.static_rows), "
                                     f"but a parameter of shape {tuple(p.shape)} has none")
        self.compiled, self.mode = bool(compiled), mode
        self._lr: dict[torch.device, Tensor] = {}

    def _lr_on(self, lr: float, device: torch.device) -> float | Tensor:
        """The lr as the update takes it: a device scalar when compiled (refilled, never remade)."""
        if not self.compiled:
            return lr
        t = self._lr.get(device)
        if t is None:
            t = self._lr[device] = torch.zeros((), dtype=torch.float64, device=device)
        return t.fill_(lr)

    def _update(self) -> Callable:
        """The update of one table's rows, compiled or not (a subclass's: its module's cache)."""
        raise NotImplementedError

    def _step_table(self, update: Callable, p: Tensor, group: dict, ids: Tensor, grads: Tensor) -> None:
        """One table's step with its rows' (ids, gradients)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        update = self._update()
        for group in self.param_groups:
            for p in group["params"]:
                got = row_grad_of(p).grad()
                if got is not None:
                    self._step_table(update, p, group, *got)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                rg = row_grad_of(p)
                if set_to_none or rg.rows.grad is None:
                    rg.zero_grad()
                else:
                    rg.rows.grad.zero_()
