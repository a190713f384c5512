"""The one fixed-size exchange between the ranks and its one fault scheme, for the head's rows
under device flags (spherical/padded_rows.py) and the app's static row-sparse gradients
(app/sparse_exchange.py). The ranks agree on a capacity once, in one host read (the caller's);
then each step every rank sends a header of ints and its tensors padded to the capacity, in two
all-gathers of a fixed size, nothing read on the host (``FixedExchange.gather_padded``). A rank
whose input cannot be sent (refused, or over the capacity) sends none and says so in its header
(raising alone would leave the others waiting in the collective): every rank voids that step
alike, its first void step since the last read is kept on the device (``FirstFault``), and the
read of the flags it rides on (heads/flag_board.py) raises on every rank in one line.
``FirstFault`` also keeps the app's first non-finite loss.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .collectives import ProcessGroup

#: a rank's error codes in a header and in a fault: its rows sent; its input failed the host's
#: checks; it had more rows (or slots) than the capacity
SENT, INVALID, TOO_LARGE = 0, 1, 2


class FirstFault:
    """The first fault since the last read, (step, rank, code, count) int64 on the device (step
    -1: none): noting one reads nothing on the host, reading it is one transfer."""

    def __init__(self, device=None):
        #: None until made: on ``device`` here, else at the first ``note``
        self.kept: Tensor | None = None if device is None else self._none(device)

    @staticmethod
    def _none(device) -> Tensor:
        return torch.tensor([-1, 0, 0, 0], dtype=torch.int64, device=device)

    def note(self, bad: Tensor, step: int | Tensor, rank: int | Tensor = 0, code: int | Tensor = 0,
             count: int | Tensor = 0) -> None:
        """Keep (``step``, ``rank``, ``code``, ``count``: ints or integer scalars on the device)
        where ``bad`` (a device bool) holds and no fault is kept yet: no host read."""
        if self.kept is None:
            self.kept = self._none(bad.device)
        kept = self.kept
        new = torch.stack([v.to(torch.int64) if isinstance(v, Tensor) else torch.full_like(kept[0], v)
                           for v in (step, rank, code, count)])
        kept.copy_(torch.where((kept[0] < 0) & bad, new, kept))

    def values(self) -> list[Tensor]:
        """The record's four scalars, for a read that transfers them with others (a
        ``heads.flag_board.FlagBoard``'s, the head's flags'); none before any ``note``."""
        return [] if self.kept is None else list(self.kept.unbind())

    @staticmethod
    def of(values: list[float]) -> tuple[int, int, int, int] | None:
        """(step, rank, code, count) of the fault in ``values`` (as a read transferred them), or
        None; the record stays, so that every later read finds it too."""
        step, rank, code, count = (int(v) for v in values) if values else (-1, 0, 0, 0)
        return (step, rank, code, count) if step >= 0 else None

    def take(self, values: list[float]) -> tuple[int, int, int, int] | None:
        """``of(values)``, the record emptied for the next reads."""
        self.kept[0].fill_(-1)
        self.kept[1:].zero_()
        return self.of(values)


class FixedExchange:
    """Every rank's header and tensors padded to the capacity, in two all-gathers of a fixed
    size; the first void step's record (``fault``)."""

    def __init__(self, pg: ProcessGroup):
        self.pg = pg
        self.fault = FirstFault()
        #: the bytes this rank received at the last ``gather_padded``
        self.received = 0

    def gather_padded(self, header: list[int], ints: list[tuple[Tensor, tuple[int, ...]]],
               floats: list[tuple[Tensor, tuple[int, ...]]]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Every rank's ``header`` (world, len(header)), and each of the (tensor, padded shape)
        pairs of ``ints`` (padded with -1) and ``floats`` (with 0) as every rank's padded tensor
        concatenated along its first dimension, rank 0 first: two all-gathers, nothing read on the host."""
        world, h = self.pg.world, len(header)
        out_i = ints[0][0].new_full((h + sum(math.prod(s) for _, s in ints),), -1)
        for j, v in enumerate(header):
            out_i[j:j + 1].fill_(v)
        out_f = floats[0][0].new_zeros(sum(math.prod(s) for _, s in floats))
        _pad_into(out_i[h:], ints)
        _pad_into(out_f, floats)
        got_i = self.pg.gather_fixed(out_i).view(world, -1)
        got_f = self.pg.gather_fixed(out_f).view(world, -1)
        self.received = world * (out_i.numel() * out_i.element_size() + out_f.numel() * out_f.element_size())
        return got_i[:, :h], _parts_of(got_i[:, h:], ints), _parts_of(got_f, floats)


def _pad_into(buffer: Tensor, parts: list[tuple[Tensor, tuple[int, ...]]]) -> None:
    """Each tensor of ``parts`` written into the corner of its padded shape's part of ``buffer``."""
    at = 0
    for t, shape in parts:
        size = math.prod(shape)
        buffer[at:at + size].view(shape)[tuple(slice(0, n) for n in t.shape)] = t
        at += size


def _parts_of(got: Tensor, parts: list[tuple[Tensor, tuple[int, ...]]]) -> list[Tensor]:
    """Each part of ``parts``' padded shapes in ``got`` (world, ...): every rank's, rank 0 first."""
    out, at = [], 0
    for _, shape in parts:
        size = math.prod(shape)
        out.append(got[:, at:at + size].reshape(got.shape[0] * shape[0], *shape[1:]))
        at += size
    return out
