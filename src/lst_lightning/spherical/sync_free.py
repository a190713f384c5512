"""The sync-free training step (``sync_every > 1``): the step reads nothing on the host,
so a GPU never waits for it and it can be captured in a CUDA graph.

Every check of the synchronous step becomes a device flag: bad target ids turn into
padding and void the step; a non-finite or singular step is masked out with
``torch.where`` (every buffer keeps its value) and counted; lr is a device scalar.
``sync()`` reads the flags every ``sync_every`` steps: it warns about skipped steps,
runs the repairs that fell due, and raises for the bad ids.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class SyncFreeSteps:
    """The device-flag side of the step, as methods of ``FactoredSphericalHead``."""

    def _init_sync_free(self) -> None:
        """The host-side counts (the device buffers _lr_t and _bad_input are declared in state.py)."""
        self._calls = 0          # training steps run (host count: no device read)
        self._synced = (0, 0)    # (steps, skipped) at the last host read
        self._lr_filled = None

    def _screen_targets(self, idx: Tensor, T: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Bad ids become padding and raise the flag; the step is void (``input_ok`` False)."""
        bad = (idx < -1) | (idx >= self.num_classes)
        input_ok = ~bad.any()
        self._bad_input |= ~input_ok
        return torch.where(bad, -1, idx), torch.where(bad, 0.0, T), input_ok

    def _masked_write(self, sv, update, finite: Tensor, dH: Tensor) -> Tensor:
        """Apply the step where it is valid, keep every buffer where it is not: no host
        read, no branch. Returns dL/dH (zero for a voided step)."""
        ok = update.ok & finite & sv.input_ok
        self._write(sv, update, ok)
        self.steps += ok
        self.skipped_nonfinite += ~ok
        if not capturing():  # a captured step is counted by its replays
            self._count_step()
        return torch.where(ok, dH, 0.0)

    def _count_step(self) -> None:
        self._calls += 1
        if self._calls % self.sync_every == 0:
            self.sync()

    def _lr_device(self) -> Tensor:
        """lr as a device scalar, refilled (outside any graph capture) when lr changed."""
        if self._lr_filled != self.lr and not capturing():
            self._lr_t.fill_(self.lr)
            self._lr_filled = self.lr
        return self._lr_t

    @torch.no_grad()
    def sync(self) -> None:
        """Read the step's device flags (one host synchronisation): warn about skipped steps,
        run the repairs that fell due, and raise if a batch since the last read had bad targets."""
        if not self.deferred_checks:
            return
        steps, skipped, bad = torch.stack([self.steps, self.skipped_nonfinite, self._bad_input.long()]).tolist()
        (n_prev, skipped_prev), self._synced = self._synced, (steps, skipped)
        if any(k & (k - 1) == 0 for k in range(skipped_prev + 1, skipped + 1)):
            warnings.warn(f"{type(self).__name__}: {skipped - skipped_prev} step(s) with non-finite or invalid "
                          f"values since the last check were skipped, the head's state left untouched "
                          f"({skipped} skipped so far)", RuntimeWarning, stacklevel=2)
        self._maintain(n_prev, steps)
        if bad:
            self._bad_input.zero_()
            raise ValueError(f"a batch since the last check (at most {self.sync_every} steps) had target ids "
                             f"outside [0, {self.num_classes}) (class ids or -1 for padding); that step was "
                             "skipped and left the head's state untouched")
