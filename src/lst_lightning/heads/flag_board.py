"""``FlagBoard``: the device flags of every party of a training step, read in one host transfer.

A head with deferred checks (``OutputHead.deferred_checks``: the factored head under device flags)
reads its flags every few steps; a training loop has device flags of its own (the app's: an
ordinary head's loss, a sparse embedding's fixed-size exchange). Each party registers the device
scalars it has to be read and what it does with their values (``register``); the board's owner
reads them all, with its own, in one transfer (``read``), on its own schedule: the head's board
(``OutputHead.flag_board``) at the head's read, where the head has deferred checks; else the
loop's own board. A party's ``on_read`` raises for its fault."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class FlagBoard:
    """The parties' device flags, read with the owner's in one host transfer."""

    def __init__(self):
        #: name -> (the device scalars to read, what to do with their values)
        self.parties: dict[str, tuple[Callable[[], list[Tensor]], Callable[[list[float]], None]]] = {}

    def register(self, name: str, tensors: Callable[[], list[Tensor]], on_read: Callable[[list[float]], None]) -> None:
        """At every read, read ``tensors()`` (device scalars, none yet: ``[]``) and hand their
        values to ``on_read`` (which raises for a fault); ``name`` registered again replaces it."""
        self.parties[name] = (tensors, on_read)

    def read(self, own: Sequence[Tensor] = ()) -> list[float]:
        """``own`` and every party's scalars in one host transfer (nothing to read: no transfer);
        each party's values handed to its ``on_read`` in the order registered (a raise ends the
        read); ``own``'s values returned."""
        parts = [list(own), *(tensors() for tensors, _ in self.parties.values())]
        flat = [t for part in parts for t in part]
        if not flat:
            return []
        device = flat[0].device
        values = torch.stack([t.to(device, torch.float64) for t in flat]).tolist()
        at = len(parts[0])
        for part, (_, on_read) in zip(parts[1:], self.parties.values()):
            on_read(values[at:at + len(part)])
            at += len(part)
        return values[:len(parts[0])]
