"""``RowGrad``: where the gradient of the rows of one table that a training step gathered lands,
in static shapes.

A table (a D x e parameter, or a bias of D) gathered with ``RowGrad.gather(table, ids)`` gets no
``.grad`` of its own: the gradient of the n rows read lands in ``rows.grad`` (a leaf of
``capacity`` rows, the step's n first, zeros after), and their ids in ``ids`` (-1 after the n,
and for padding ids < 0). A row-sparse optimiser (``RowAdam``) reads the pair. Every shape is
fixed by the batch's, so ``torch.compile`` takes the gather and its backward whole.

``capacity`` grows to the largest n gathered, in eager mode; a compiled forward cannot make a
new leaf, so a model is compiled after one eager step (or ``reserve(n)``): a larger n under
``torch.compile`` is refused with that advice. One gather per table per forward and backward;
in eager mode a gather that finds the gradient of an earlier one (gradient accumulation: several
forwards and backwards before the optimizer's step) keeps it aside, and ``grad()`` holds them
all. A compiled forward cannot (the app compiles only without accumulation).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class _GatherRows(torch.autograd.Function):
    """``table.index_select(0, ids)``, its gradient handed to ``sink`` (n rows) instead of the table."""

    @staticmethod
    def forward(ctx, table: Tensor, ids: Tensor, sink: Tensor) -> Tensor:
        return table.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, None, grad


class RowGrad(nn.Module):
    """The ids and the rows' gradient of one table (see the module docstring). Made by
    ``static_rows`` (embedding.py); the table's ``row_grad`` attribute names it."""

    def __init__(self, table: nn.Parameter, capacity: int = 0):
        super().__init__()
        if not isinstance(table, nn.Parameter) or table.dim() < 1:
            raise TypeError(f"RowGrad needs a table parameter (D, ...), got {type(table).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.row_shape = tuple(table.shape[1:])
        self.num_rows = table.shape[0]
        self.register_buffer("ids", torch.full((capacity,), -1, dtype=torch.long, device=table.device),
                             persistent=False)
        #: the gradient of the rows gathered lands in ``rows.grad``; its values are never read
        self.rows = torch.zeros(capacity, *self.row_shape, dtype=table.dtype, device=table.device,
                                requires_grad=True)
        #: the gradient as another part set it (several processes: the ranks' average), or None
        self._set: tuple[Tensor, Tensor] | None = None
        #: the (ids, rows' gradient) of the earlier forwards of this step (gradient accumulation)
        self._kept: list[tuple[Tensor, Tensor]] = []
        table.row_grad = self

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        with torch.no_grad():  # a leaf still, on the table's device and in its dtype
            self.rows = fn(self.rows.detach()).requires_grad_()
        return self

    def reserve(self, n: int) -> None:
        """Room for gathers of up to ``n`` rows (eager only: a compiled forward cannot make a leaf)."""
        if n <= self.capacity:
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(f"RowGrad: a gather of {n} rows, beyond the {self.capacity} reserved, under "
                               "torch.compile: run one step eagerly before compiling, or call reserve(n)")
        self.ids = torch.full((n,), -1, dtype=torch.long, device=self.ids.device)
        self.rows = torch.zeros(n, *self.row_shape, dtype=self.rows.dtype, device=self.rows.device,
                                requires_grad=True)

    def gather(self, table: Tensor, ids: Tensor) -> Tensor:
        """``table[ids]`` (padding ids < 0 read row 0), shape ``ids.shape + table.shape[1:]``; while
        autograd records, the rows' gradient goes to ``rows.grad`` and the ids to ``ids``."""
        flat = ids.reshape(-1)
        safe = flat.clamp(min=0)
        if not (torch.is_grad_enabled() and table.requires_grad):
            return table.index_select(0, safe).view(*ids.shape, *self.row_shape)
        n = flat.shape[0]
        if not torch.compiler.is_compiling() and self.rows.grad is not None:
            self._kept.append((self.ids.clone(), self.rows.grad))  # an earlier micro-batch's rows
            self.rows.grad = None
        self.reserve(n)
        cap = self.capacity
        tail = torch.full((cap - n,), -1, dtype=torch.long, device=flat.device)
        self.ids.copy_(torch.cat([flat.long(), tail]))
        sink = self.rows if n == cap else self.rows[:n]
        return _GatherRows.apply(table, safe, sink).view(*ids.shape, *self.row_shape)

    def grad(self) -> tuple[Tensor, Tensor] | None:
        """(ids, rows' gradient), each of ``capacity`` rows (or as ``set_grad`` gave them), or None
        when no backward reached them."""
        if self._set is not None:
            return self._set
        parts = self._kept + ([] if self.rows.grad is None else [(self.ids, self.rows.grad)])
        if len(parts) <= 1:
            return parts[0] if parts else None
        return torch.cat([i for i, _ in parts]), torch.cat([r for _, r in parts])

    def set_grad(self, ids: Tensor, rows: Tensor) -> None:
        """Replace the gradient until ``zero_grad`` (ids (n,), -1 ignored, rows (n, ...), any n):
        the average over several processes (app/sparse_exchange.py), eager only."""
        self._set = (ids, rows)

    def zero_grad(self) -> None:
        self._set = None
        self._kept = []
        self.rows.grad = None


def row_grad_of(table: Tensor) -> RowGrad | None:
    """The ``RowGrad`` that takes ``table``'s gathered rows' gradient, or None (an ordinary parameter)."""
    rg = getattr(table, "row_grad", None)
    return rg if isinstance(rg, RowGrad) else None
