"""Checkpoints every few steps, every few minutes, after every validation and on SIGTERM.

Lightning's ``ModelCheckpoint`` does the saving, the naming and the pruning; this subclass
only adds the triggers it cannot combine: ``every_n_steps`` (its own
``every_n_train_steps``) together with ``every_minutes``, a save after every validation
(it saves after validation only once per epoch), and a save when the run stops on
SIGTERM (Lightning raises ``SIGTERMException`` at the end of the batch it received the
signal in, on every rank).

Files, in ``dirpath``: ``last.ckpt`` (the newest, rewritten at every save, also by a
resumed run: no ``last-v1.ckpt``) and the newest ``keep`` saves as ``step<N>.ckpt`` (older
ones deleted, by a resumed run too; ``keep: 0``: last.ckpt only).
Every write goes through the trainer's checkpoint IO, which replaces a file atomically
(``AtomicCheckpointIO``): a kill mid-write leaves the previous file whole. When a step file
was just written, ``last.ckpt`` becomes a hard link to it (replaced by a rename too) rather
than a second copy: one write and one file's worth of disk per save (at D = 10^7 a
checkpoint is about 6 GB); pruning the step file later leaves last.ckpt whole.
"""
from __future__ import annotations

import time
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..checkpoint_io import link_atomically


class PeriodicCheckpoint(ModelCheckpoint):
    def __init__(self, dirpath: str, every_n_steps: int = 1000, every_minutes: float | None = 30.0,
                 after_validation: bool = True, keep: int = 1):
        for name, value in (("every_n_steps", every_n_steps), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"callbacks.checkpoint.{name} must be an int >= 0, got {value!r}")
        if every_minutes is not None and (isinstance(every_minutes, bool) or not isinstance(every_minutes, (int, float))
                                          or not every_minutes > 0):
            raise ValueError(f"callbacks.checkpoint.every_minutes must be > 0 or null, got {every_minutes!r}")
        # monitor="step", mode="max": the newest `keep` saves are the top k (monitor=None allows k <= 1 only)
        super().__init__(dirpath=dirpath, filename="step{step}", auto_insert_metric_name=False,
                         monitor="step" if keep else None, mode="max", save_top_k=keep, save_last=True,
                         every_n_train_steps=every_n_steps, every_n_epochs=0, enable_version_counter=False)
        self.every_minutes, self.after_validation = every_minutes, after_validation
        self._clock = time.monotonic()

    @property
    def state_key(self) -> str:
        # Lightning's key holds the triggers: a resumed run with other ones would not get its
        # state back (the saves it keeps), and would leave the old ones undeleted
        return type(self).__name__

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # a resumed run writes into its own checkpoints: no news
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # every_n_steps
        if self._defer_save_until_validation:
            # Lightning defers an epoch's last save to a validation it expects (monitored
            # metrics): "step" is never stale, and that validation may not come
            self._defer_save_until_validation = False
            self.save_now(trainer)
        if self.every_minutes is not None:
            due = time.monotonic() - self._clock >= 60.0 * self.every_minutes
            if trainer.strategy.broadcast(due):  # rank 0's clock decides: every rank saves together
                self.save_now(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.after_validation:
            self.save_now(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save_now(trainer)  # the final state, whatever the triggers

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Only a preemption: another exception may leave a diverged or half-stepped state.
        if isinstance(exception, SIGTERMException):
            self.save_now(trainer, preempted=True)

    def save_now(self, trainer: pl.Trainer, preempted: bool = False) -> None:
        """step<N>.ckpt (kept among the newest ``keep``) and last.ckpt, unless this step is saved
        or (but when ``preempted``) an accumulation window is half done: its gradients are in
        no checkpoint, a time-triggered save waits for the window's optimizer step."""
        if self._should_skip_saving_checkpoint(trainer):  # not fitting, sanity check, or saved at this step
            return
        if not preempted and trainer.state.stage == "train" and trainer.fit_loop.epoch_loop._should_accumulate():
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        self._clock = time.monotonic()

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        saved = self._last_checkpoint_saved
        last = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        if not (saved and self._last_global_step_saved == trainer.global_step and saved != last
                and _is_local_file_protocol(last)):
            super()._save_last_checkpoint(trainer, monitor_candidates)  # no step file at this step
            return
        linked = link_atomically(saved, last) if trainer.is_global_zero else True
        if not trainer.strategy.broadcast(linked):  # no hard links on this file system: a copy
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        self.last_model_path = last
