"""Row-sparse gradients averaged over the processes by all-gathers, on any backend.

A sparse input embedding (``nn.Embedding(sparse=True)``, or with static rows a
``RowEmbedding``) and a ``head.sparse`` head's class rows get row-sparse gradients: (row ids,
rows), only the rows a step read (torch sparse COO tensors, or static rows' (ids, rows), whose
average is handed back to their ``RowGrad``). DDP
all-reduces those only over gloo; NCCL has no sparse all-reduce. So the app keeps these
parameters out of DDP (``LanguageModel.setup``) and averages their gradients itself, the
same way on every backend:

1. each rank coalesces its gradient (n_r distinct rows);
2. all-gathers the counts n_r, pads its ids and rows to n = max n_r, all-gathers them and
   keeps the first n_r of rank r's (``ProcessGroup.gather_ragged``, the head's ragged
   gather);
3. coalesces (rows touched by several ranks are summed) and divides by the world size,
   as DDP averages.

Each rank receives world x (8 + n x (8 + row bytes)) bytes: it depends on the rows the
step touched, never on the number of rows D of the table.

Static rows (``optimizer.embedding=row_adam``: a ``RowGrad``'s ids and rows) are exchanged in
fixed shapes, with no host read a step (``StaticRowsExchange``, a client of the head's one
fixed-size exchange, distributed/fixed_exchange.py): the ranks agree on a capacity C at their first
exchange (the most rows a rank sends, one host read), then each step every rank sends its count
and its ids and rows padded to C, in two all-gathers of a fixed size; the rows of repeated ids
are summed by ``coalesce_rows`` (a sort of fixed size) and divided by the world size. A rank
with more than C rows sends none: every rank then leaves that step's rows of the table
untouched, and the next read of the board the exchange's fault is registered on (a
``heads.flag_board.FlagBoard``: the head's, read with its flags every ``sync_every`` steps, or the
app's own, every ``check_every`` steps; and at the end of training) raises on every rank, in one
line, naming the step.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..distributed.collectives import ProcessGroup
from ..distributed.fixed_exchange import TOO_LARGE, FixedExchange
from ..heads.flag_board import FlagBoard
from ..rows import RowGrad, row_grad_of
from ..rows.coalesce import coalesce_rows


@torch.no_grad()
def average_row_sparse(grad: Tensor, group=None) -> tuple[Tensor, int]:
    """The average over the ranks of the row-sparse gradient ``grad`` (a sparse COO
    tensor of sparse dim 1, as an embedding's backward gives, repeated rows allowed),
    coalesced; and the bytes this rank received. One process: ``grad`` coalesced, 0."""
    if not grad.is_sparse or grad.sparse_dim() != 1:
        raise ValueError(f"a row-sparse gradient is a sparse COO tensor with sparse_dim 1, got "
                         f"{'sparse_dim ' + str(grad.sparse_dim()) if grad.is_sparse else 'a dense tensor'}")
    grad = grad.coalesce()
    pg = ProcessGroup.current(group)
    if pg.world == 1:
        return grad, 0
    (ids, rows), sizes = pg.gather_ragged([grad.indices()[0], grad.values()], [0, 0.0])
    n = max(sizes)
    received = pg.world * 8  # the counts, int64
    if n == 0:  # no rank touched a row
        return grad, received
    # the ids come from coalesced gradients of this shape: no invariant check needed
    total = torch.sparse_coo_tensor(ids[None], rows, grad.shape, check_invariants=False).coalesce()
    received += pg.world * n * (ids.element_size() + math.prod(rows.shape[1:]) * rows.element_size())
    averaged = torch.sparse_coo_tensor(total.indices(), total.values() / pg.world, grad.shape, is_coalesced=True,
                                       check_invariants=False)
    return averaged, received


class StaticRowsExchange(FixedExchange):
    """The average over the ranks of one table's static rows (a ``RowGrad``), in fixed shapes
    after the first exchange (see the module docstring)."""

    def __init__(self, table: nn.Parameter, pg: ProcessGroup, sizes: list[int]):
        super().__init__(pg)
        self.shape, self.device = tuple(table.shape), table.device
        #: the rows a rank sends each step: the most a rank had at the first exchange
        self.capacity = max(sizes)

    def average(self, rows: RowGrad, got: tuple[Tensor, Tensor] | None, step: int) -> int:
        """``rows``' gradient (``got``: its ``grad()``) replaced by the ranks' average (every rank's
        ids, repeated ids summed, -1 on the slots no id fills); returns the bytes this rank received.
        The first step whose rows were left out is ``fault``, with the most rows a rank had then."""
        row_shape, dev = self.shape[1:], self.device
        ids, values = got if got is not None else (torch.empty(0, dtype=torch.int64, device=dev),
                                                   torch.empty(0, *row_shape, dtype=rows.rows.dtype, device=dev))
        n, C = ids.shape[0], self.capacity
        sent = n if n <= C else 0  # a rank over the capacity sends no rows, and its count
        counts, (all_ids,), (all_rows,) = self.gather_padded([n], [(ids[:sent], (C,))],
                                                             [(values[:sent], (C, *row_shape))])
        counts = counts[:, 0]
        over = (counts > C).any()
        uids, summed = coalesce_rows(torch.where(over, -1, all_ids), all_rows)
        self.fault.note(over, step, code=TOO_LARGE, count=counts.max())
        rows.set_grad(uids, summed / self.pg.world)
        return self.received

    def check(self, values: list[float]) -> None:
        """Raise, on every rank alike (the fault is the gathered counts'), for a step left out
        (``values``: the fault as a board's read transferred it)."""
        fault = self.fault.of(values)
        if fault is not None:
            step, _, _, n = fault
            raise ValueError(f"the row-sparse gradient of a table {self.shape}: at step {step} a rank's batch "
                             f"gathered {n} rows, more than the {self.capacity} the ranks agreed at their first step, "
                             "so every rank left that step's rows of the table untouched; keep every batch's shape "
                             "the first one's (or smaller)")


#: each static-rows table's exchange, made at its first exchange
_EXCHANGES: "weakref.WeakKeyDictionary[RowGrad, StaticRowsExchange]" = weakref.WeakKeyDictionary()


def static_rows_exchange(table: nn.Parameter, rows: RowGrad, pg: ProcessGroup, n: int,
                         board: FlagBoard | None) -> StaticRowsExchange:
    """``table``'s exchange, its fault registered on ``board`` (the run's that steps it); the first
    call agrees on its capacity (every rank's rows ``n``, one host read)."""
    ex = _EXCHANGES.get(rows)
    if ex is None:
        ex = _EXCHANGES[rows] = StaticRowsExchange(table, pg, pg.all_gather_ints([n], table.device)[:, 0].tolist())
    if board is not None:
        board.register(f"static rows {id(ex)}", ex.fault.values, ex.check)
    return ex


@torch.no_grad()
def average_sparse_gradients(params: Iterable[nn.Parameter], group=None, step: int = 0,
                             board: FlagBoard | None = None) -> int:
    """Replace each parameter's row-sparse gradient by its average over the ranks (every
    rank must pass the same parameters in the same order); a rank that has no gradient
    for one takes part with no rows. Static rows go in fixed shapes (``step``: the optimizer
    step, named if a rank's rows had to be left out, at the next read of ``board``, where their
    faults are registered; None: read at the end of this call, one host read). Returns the bytes
    this rank received."""
    received = 0
    pg = ProcessGroup.current(group)
    if pg.world == 1:
        return 0
    own, board = board is None, FlagBoard() if board is None else board
    for p in params:
        rows = row_grad_of(p)
        if rows is not None:  # static rows (lst_lightning.rows)
            got = rows.grad()
            n = got[0].shape[0] if got is not None else 0
            received += static_rows_exchange(p, rows, pg, n, board).average(rows, got, step)
            continue
        grad = p.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                           p.new_empty((0, *p.shape[1:])), p.shape)
        averaged, n = average_row_sparse(grad, group)
        received += n
        if p.grad is not None or averaged._nnz():
            p.grad = averaged
    if own:
        board.read()
    return received
