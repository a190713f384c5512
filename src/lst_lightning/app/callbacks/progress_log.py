"""A log line every few steps (step, loss, tokens/s, ETA or a time budget's time left) and one
per validation, so that
a run whose output goes to a file (nohup, a batch job) shows its progress, and the run's
``train.log`` keeps it. Rank zero only."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning.pytorch as pl

from .time_budget import budget_timer

log = logging.getLogger("lst_lightning.progress")


def clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03``."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLog(pl.Callback):
    """Logs ``step 200/4000  loss 6.512  1830 tokens/s  ETA 2:41`` (and ``1:10 of training left``
    with a time budget) every ``every`` steps
    (0: never) and the validation metrics after each validation. ``log_file``: where a
    process without logging handlers (a spawned worker: Hydra configured only the
    launching process) writes the lines besides stderr."""

    def __init__(self, every: int = 100, log_file: str | Path | None = None):
        if not (isinstance(every, int) and every >= 0):
            raise ValueError(f"callbacks.progress_every must be an int >= 0 (0: off), got {every!r}")
        self.every = every
        self.log_file = log_file
        self._start = 0.0
        self._first_step = 0
        self._tokens = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        from ..quiet import quiet_libraries, show_our_lines  # noqa: PLC0415

        quiet_libraries()  # again: a spawned worker starts with default filters
        if trainer.is_global_zero:
            show_our_lines(self.log_file)

    def on_train_start(self, trainer, pl_module) -> None:
        self._start, self._first_step, self._tokens = time.perf_counter(), trainer.global_step, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += len(batch[-1]) * trainer.world_size  # one prediction per example, on every rank
        step = trainer.global_step
        if not (self.every and trainer.is_global_zero and step % self.every == 0 and step > self._first_step):
            return
        elapsed = time.perf_counter() - self._start
        total = trainer.estimated_stepping_batches
        parts = [f"step {step}/{total}" if total != float("inf") else f"step {step}"]
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            parts.append(f"loss {float(loss):.4g}")
        parts.append(f"{self._tokens / elapsed:.0f} tokens/s")
        if total != float("inf"):
            parts.append(f"ETA {clock((total - step) * elapsed / (step - self._first_step))}")
        budget = budget_timer(trainer)
        if budget is not None:  # trainer.max_time: training time, validation excluded
            parts.append(f"{clock(max(budget.time_remaining(), 0.0))} of training left")
        log.info("  ".join(parts))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        val = {k[4:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        shown = ", ".join(f"{k} {v:.4g}" for k, v in val.items() if k in ("loss", "top1_error", "top5_error", "mrr"))
        log.info("validation at step %d: %s", trainer.global_step, shown)
