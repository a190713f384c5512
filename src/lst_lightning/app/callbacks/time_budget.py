"""A run's time budget (``trainer.max_time``) on the training clock: validation left out.

Lightning's own ``Timer`` counts the validation passes inside ``fit`` as training time, so a
head whose evaluation is slower would train less in the same budget. ``TrainingClock`` is that
``Timer`` on training time alone: the app makes it from ``trainer.max_time`` in place of
Lightning's, training stops once the training time reaches the budget, the schedule's
``over: budget`` decays over it (app/schedule.py), the progress line and bar show what is left,
and a checkpoint holds it, so a resumed run goes on with the time it had left.

Its clock is the wall (``clock="wall"``, ``time.perf_counter``) or this process's CPU time
(``clock="cpu"``, ``time.process_time``: every thread of the process, none of the machine's
other processes). On a machine that other jobs share, the CPU clock gives each run the same
work whatever the load, where the wall clock gives it what the load leaves; a time-based
``trainer.val_check_interval`` then counts on the same clock."""
from __future__ import annotations

import time

from lightning.pytorch.callbacks import Timer
from lightning.pytorch.trainer.states import RunningStage

from ..checks import CLOCK_NAMES


#: the clocks a budget can count on: the wall, or this process's CPU time
CLOCKS = dict(zip(CLOCK_NAMES, (lambda: time.perf_counter(), lambda: time.process_time())))


class TrainingClock(Timer):
    """Lightning's ``Timer`` whose training time excludes validation; ``duration`` as
    Lightning's (``DD:HH:MM:SS``, a dict of timedelta's fields, a timedelta) or None (no budget:
    the clock only counts); ``clock``: "wall" or "cpu" (``CLOCKS``)."""

    def __init__(self, duration=None, clock: str = "wall"):
        if clock not in CLOCKS:
            raise ValueError(f"clock={clock!r}: must be one of {sorted(CLOCKS)}")
        super().__init__(duration=duration, interval="step", verbose=True)
        self.clock = clock
        self._now = CLOCKS[clock]
        self._at_last_val = 0.0  # training seconds at the last validation (the CPU clock's val interval)
        self._train_s = 0.0  # training seconds since this process started training
        self._since: float | None = None  # when training last (re)started, None while it is not running

    def time_elapsed(self, stage: str = RunningStage.TRAINING) -> float:
        """Training seconds, validation excluded, a resumed run's earlier ones included (other
        stages: Lightning's own)."""
        if RunningStage(stage) != RunningStage.TRAINING:
            return super().time_elapsed(stage)
        return self._offset + self._train_s + (self._now() - self._since if self._since is not None else 0.0)

    def _pause(self) -> None:
        if self._since is not None:
            self._train_s += self._now() - self._since
            self._since = None

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._since = self._now()
        self._at_last_val = self.time_elapsed()

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._pause()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # A time-based val_check_interval is Lightning's wall clock (time.monotonic since its last
        # validation); on the CPU clock its last validation is moved back by the CPU time since.
        if self.clock != "wall" and getattr(trainer, "_val_check_time_interval", None) is not None:
            trainer._last_val_time = time.monotonic() - (self.time_elapsed() - self._at_last_val)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        self._pause()
        self._at_last_val = self.time_elapsed()

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        # trainer.training is False here (the state is "validating"): a validation inside fit
        # hands back to training
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._since = self._now()


def budget_timer(trainer) -> Timer | None:
    """The trainer's ``Timer`` with a duration (``TrainingClock`` from ``trainer.max_time``, or
    one of the caller's), or None: a run without a time budget."""
    return next((c for c in trainer.callbacks if isinstance(c, Timer) and c.time_remaining() is not None), None)


def training_clock(trainer) -> Timer | None:
    """The clock of ``train/clock_s``: the budget's, else a ``TrainingClock`` that only counts
    (``clock=cpu`` without a budget), else None."""
    return budget_timer(trainer) or next((c for c in trainer.callbacks if isinstance(c, TrainingClock)), None)
