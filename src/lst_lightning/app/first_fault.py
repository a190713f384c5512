"""``FirstFault``: the first step at which a condition on the device held, with a count of that
step, kept on the device (noting it reads nothing on the host) and read on the host in one
transfer. The app's deferred checks keep theirs so: the training loss's (loss_checks.py) and the
static rows' exchange (sparse_exchange.py)."""
from __future__ import annotations

import torch
from torch import Tensor


class FirstFault:
    def __init__(self):
        self._kept: Tensor | None = None  # (step, count) on the device; step -1: none yet

    def note(self, bad: Tensor, step: int, count: Tensor | None = None) -> None:
        """Keep ``step`` (and ``count``, an integer tensor) where ``bad`` (a device bool) holds and
        no fault is kept yet: no host read."""
        if self._kept is None:
            self._kept = torch.tensor([-1, 0], dtype=torch.int64, device=bad.device)
        new = torch.stack([torch.full_like(self._kept[0], step),
                           self._kept[1] if count is None else count.to(torch.int64)])
        self._kept.copy_(torch.where((self._kept[0] < 0) & bad, new, self._kept))

    def read(self) -> tuple[int, int] | None:
        """(step, count) of the first fault, or None: one host read (none before any ``note``)."""
        if self._kept is None:
            return None
        step, count = self._kept.tolist()
        return (step, count) if step >= 0 else None
