"""``LossChecks``: the app's device flags where the head has no deferred checks, read on the host
in one transfer every ``check_every`` steps (and at the end of training), so that the step never
waits for the GPU: the training loss of an ordinary head checked for non-finite values on the
device, and the flags the app's other parties register on its board (a sparse embedding's
fixed-size exchange, app/sparse_exchange.py). A non-finite loss stops the run with the first step
that had one. Eager heads still raise at once (their own host check,
``heads.targets.reduce_rows``); a compiled head leaves the check to this. A head with deferred
checks carries the app's flags on its own board, read with its flags every ``sync_every`` steps
(``LanguageModel.flag_board``)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..distributed.fixed_exchange import FirstFault
from ..heads.flag_board import FlagBoard
from ..spherical.driving import SYNC_EVERY


class LossChecks:
    def __init__(self, check_every: int = SYNC_EVERY):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.check_every = check_every
        self.first_bad = FirstFault()  # the first step with a non-finite loss
        #: the app's board: the loss's flags and the other parties', read every ``check_every`` steps
        self.board = FlagBoard()
        self.board.register("loss", self.first_bad.values, self._raise)
        self.read_at = 0  # the step of the board's last read

    def record(self, loss: Tensor | None, step: int) -> None:
        """Note this step's loss (no host read; None: no loss to note, a self-updating head's);
        read the board when ``check_every`` steps are due."""
        if loss is not None:
            with torch.no_grad():
                self.first_bad.note(~torch.isfinite(loss.detach()), step)
        if (step + 1) % self.check_every == 0:
            self.read(step)

    def read(self, step: int) -> None:
        """Read the board (one host transfer): FloatingPointError if a step so far had a
        non-finite loss, and each other party's error for its fault."""
        self.read_at = step
        self.board.read()

    def _raise(self, values: list[float]) -> None:
        fault = FirstFault.of(values)
        if fault is not None:
            raise FloatingPointError(f"non-finite training loss at step {fault[0]} (read at step {self.read_at}; "
                                     f"the loss is read every {self.check_every} steps)")
