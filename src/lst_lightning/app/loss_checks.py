"""``LossChecks``: the training loss of an ordinary head checked for non-finite values on the
device, read on the host every ``check_every`` steps (and at the end of training), so that the
step never waits for the GPU to say whether its loss was finite. A non-finite loss stops the run
with the first step that had one. Eager heads still raise at once (their own host check,
``heads.targets.reduce_rows``); a compiled head leaves the check to this."""
from __future__ import annotations

import torch
from torch import Tensor

from ..spherical.driving import SYNC_EVERY
from ..spherical.fixed_exchange import FirstFault


class LossChecks:
    def __init__(self, check_every: int = SYNC_EVERY):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.check_every = check_every
        self.first_bad = FirstFault()  # the first step with a non-finite loss

    def record(self, loss: Tensor, step: int) -> None:
        """Note this step's loss (no host read); read the flags when ``check_every`` steps are due."""
        with torch.no_grad():
            self.first_bad.note(~torch.isfinite(loss.detach()), step)
        if (step + 1) % self.check_every == 0:
            self.read(step)

    def read(self, step: int) -> None:
        """Raise FloatingPointError if a step so far had a non-finite loss (one host read)."""
        fault = self.first_bad.read()
        if fault is not None:
            raise FloatingPointError(f"non-finite training loss at step {fault[0]} (read at step {step}; the loss "
                                     f"is read every {self.check_every} steps)")
