"""How the ranks of a multi-process head share each training step's rows under device flags
(``sync_every > 1``) with no host read (``processes.padded``), a client of the one fixed-size
exchange and its fault scheme (fixed_exchange.py):

- the capacity, agreed at the first training step in the one host read of ``Processes.agree``:
  the most rows C and target slots K a rank sends, the largest of the ranks' first batches' (and
  of ``head.rows_per_rank``), where the step runs compiled the batch size of those (batch_shapes.py);
- each step works on the gathered batch, the ranks' rows in rank order each followed by its
  padding (H 0, ids -1, values 0: they add nothing); the "mean" reduction divides by the real
  rows, the headers' sum (``rows``, a device count); a rank's own rows of dL/dH are the static
  slice [rank C, rank C + m);
- a rank whose input fails ``prepare`` or exceeds the capacity sends no rows and an error code,
  keeps its message, and its H gets a zero gradient; every rank voids the step (the header folds
  into the step's ``input_ok``), and the next read of the flags raises on every rank, in one
  line, with that rank's message and the step's number.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..distributed.collectives import ProcessGroup
from ..distributed.fixed_exchange import INVALID, SENT, TOO_LARGE, FirstFault, FixedExchange
from .batch_shapes import padded_rows, padded_slots

#: the code of a void step whose gathered batch had bad ids (beside fixed_exchange.py's)
BAD_IDS = 3


class _VoidHidden(torch.autograd.Function):
    """No rows standing for a void rank's H: that H gets a zero gradient."""

    @staticmethod
    def forward(ctx, H: Tensor, width: int, device: torch.device) -> Tensor:
        ctx.like = (H.shape, H.dtype, H.device)
        return torch.zeros(0, width, dtype=H.dtype, device=device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.like
        return torch.zeros(shape, dtype=dtype, device=device), None, None


class PaddedRows(FixedExchange):
    """The ranks' rows of each training step, padded to the capacity agreed at the first."""

    def __init__(self, pg: ProcessGroup):
        super().__init__(pg)
        #: (rows C, slots K) a rank sends each step; None until the first training step
        self.capacity: tuple[int, int] | None = None
        #: this rank's code for the step ``prepare`` checked and ``gather`` sends (None: none checked)
        self.code: int | None = None
        #: this rank's message for its first void input since the last read of the flags
        self.message: str | None = None
        # on the device, made at the agreement: the last gathered header (world, 2: rows, code),
        # and its real rows (the sum); the first void step since the last read is ``fault``
        self.header = self.rows = None

    # -- the host's part, before the step --------------------------------------------------------
    def agree(self, head, sizes: list[list[int]]) -> None:
        """The capacity from every rank's (rows, slots) of its first training batch (``sizes``,
        read on the host by ``Processes.agree``) and ``head.rows_per_rank``."""
        rows, slots = zip(*sizes)
        self.capacity = (max(*rows, head.rows_per_rank or 0), max(slots))
        if head.plan.compiled:  # a batch size (batch_shapes.py): later batches of up to that many rows fit
            self.capacity = padded_rows(self.capacity[0], head.driving.batch_sizes), padded_slots(self.capacity[1])
        dev = head.device
        self.header = torch.zeros(self.pg.world, 2, dtype=torch.int64, device=dev)
        self.rows = torch.zeros((), dtype=torch.int64, device=dev)
        self.fault = FirstFault(dev)
        self.code = SENT

    def prepare(self, head, prepare) -> tuple[Tensor, Tensor, Tensor]:
        """``prepare()`` on this rank, its failure kept for the read: the checked batch, or no
        rows where it failed or exceeds the capacity (``void``)."""
        rows, slots = self.capacity
        try:
            Hx, idx, T = prepare()
            if Hx.shape[0] > rows or idx.shape[1] > slots:
                self.code, text = TOO_LARGE, (
                    f"had {Hx.shape[0]} rows of {idx.shape[1]} target slots, more than the {rows} rows "
                    f"of {slots} slots the ranks agreed at their first training step to send each step: set "
                    "head.rows_per_rank on every rank before the first step to the most rows a rank's batch holds, "
                    "pad the batches to one size, or use sync_every=1")
            else:
                self.code = SENT
                return Hx, idx, T
        except (ValueError, TypeError) as e:
            self.code, text = INVALID, f"{type(e).__name__}: {e}"
        if self.message is None:
            self.message = text
        return (torch.zeros(0, head.width, dtype=head.dtype, device=head.device),
                torch.zeros(0, slots, dtype=torch.int64, device=head.device),
                torch.zeros(0, slots, dtype=head.dtype, device=head.device))

    @property
    def void(self) -> bool:
        """Whether this rank's input to the step being prepared failed (it sends no rows)."""
        return self.code not in (None, SENT)

    @staticmethod
    def void_hidden(head, H) -> Tensor:
        """What a void rank hands the step for its H: no rows, and a zero gradient for H."""
        if isinstance(H, Tensor) and H.is_floating_point():
            return _VoidHidden.apply(H, head.hidden_dim, head.device)
        return torch.zeros(0, head.hidden_dim, dtype=head.dtype, device=head.device, requires_grad=True)

    # -- the device's part: the exchange, and the step's flags -------------------------------------
    def gather(self, Hx: Tensor, idx: Tensor, T: Tensor) -> tuple[Tensor, Tensor, Tensor, slice]:
        """Every rank's rows padded to the capacity, in two all-gathers and no host read; this
        rank's rows in the gathered batch."""
        (C, K), m, width = self.capacity, idx.shape[0], Hx.shape[1]
        header, (idx,), (Hx, T) = self.gather_padded([m, self.code], [(idx, (C, K))], [(Hx, (C, width)), (T, (C, K))])
        self.header.copy_(header)
        self.rows.copy_(self.header[:, 0].sum())
        self.code = None
        lo = self.pg.rank * C
        return Hx, idx, T, slice(lo, lo + m)

    def checked(self, input_ok: Tensor) -> Tensor:
        """``input_ok`` and every rank sent its rows this step (a device bool)."""
        return input_ok & (self.header[:, 1] == SENT).all()

    def note_fault(self, first: Tensor, bad: Tensor, step: Tensor) -> None:
        """Record who voided the step ``step`` where it is the first void step since the read
        (``first``): the first rank that sent an error code, else the rank whose rows held the
        first bad id (``bad``: the gathered batch's bad slots)."""
        codes = self.header[:, 1]
        failing = codes != SENT
        sender = failing.to(torch.int64).argmax()
        holder = bad.any(1).to(torch.int64).argmax() // self.capacity[0]
        any_failing = failing.any()
        rank = torch.where(any_failing, sender, holder)
        code = torch.where(any_failing, codes.gather(0, sender.view(1))[0], BAD_IDS)
        self.fault.note(first, step, rank, code)

    # -- the read of the flags ----------------------------------------------------------------------
    def flags(self) -> list[Tensor]:
        """What the read of the flags transfers for the exchange: the recorded fault."""
        return self.fault.values()

    def read(self, values: list[float] | None) -> tuple[int, str | None] | None:
        """After a read of the flags that found a void step (``values``: the fault as read;
        None: no void step): its rank and why, None for bad ids in that rank's rows (a void
        rank's own message is gathered: every rank reads the flags at the same step, so every
        rank takes part). Every rank's message is dropped for the next reads."""
        out = None
        if values is not None:
            _, rank, code, _ = self.fault.take(values) or (0, 0, SENT, 0)
            if code == BAD_IDS:
                out = (rank, None)
            else:
                said = self.pg.all_gather_objects(self.message)
                out = (rank, f"was invalid ({said[rank]})" if code == INVALID else said[rank])
        self.message = None
        return out
