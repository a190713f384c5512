"""Checkpoints every few minutes (and optionally every few steps), after every validation,
at the end and on SIGTERM, at a bounded cost.

Lightning's ``ModelCheckpoint`` does the saving, the naming and the pruning; this subclass
adds the triggers it cannot combine: ``every_minutes`` together with ``every_n_steps``, a
save after every validation (it saves after validation only once per epoch), and a save
when the run stops on SIGTERM (Lightning raises ``SIGTERMException`` at the end of the
batch it received the signal in, on every rank).

The cost is bounded: each periodic save (by time, by steps, after a validation) is timed
for as long as it holds the training loop up or, written in the background, until it is on
disk (whichever is longer: on a machine with few cores the writer takes CPU from training),
and the next one waits until the training since then is at least that time divided by
``max_overhead`` (5 %: a save of 3 s is followed by at least 60 s of training). So saving
stays within ``max_overhead`` of the wall time whatever a step costs on this machine (the
same setting means 10 s on a CPU and 1 s on a GPU for a step count). Before the first save
has been timed, its cost is estimated from the bytes to write (the model's and optimizers'
tensors) at ``FIRST_SAVE_BYTES_PER_S``, so the first save is bounded too. The save at the
end and on SIGTERM are always made.

Files, in ``dirpath``: ``last.ckpt`` (the newest, rewritten at every save, also by a
resumed run: no ``last-v1.ckpt``) and the newest ``keep`` saves as ``step<N>.ckpt`` (older
ones deleted, by a resumed run too; ``keep: 0``: last.ckpt only).
Every write goes through the trainer's checkpoint IO, which replaces a file atomically
(``AtomicCheckpointIO``): a kill mid-write leaves the previous file whole. With
``AsyncAtomicCheckpointIO`` (the app's) the write runs in the background on a snapshot of
the step, at most one at a time; the SIGTERM save and the final one are waited for. When a
step file was just written, ``last.ckpt`` becomes a hard link to it (replaced by a rename
too, after the step file is on disk) rather than a second copy: one write and one file's
worth of disk per save (at D = 10^7 a checkpoint is about 6 GB); pruning the step file
later leaves last.ckpt whole.
"""
from __future__ import annotations

import os
import time
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..checkpoint_io import AsyncAtomicCheckpointIO, copy_atomically, link_atomically


#: bytes per second assumed for a first save, before one is timed: below what a 2-core CPU
#: machine writes (1.2 GB from the snapshot to the file on disk in 4.2 s at D = 10^6,
#: docs/results/checkpoints.md), with a margin
FIRST_SAVE_BYTES_PER_S = 150e6


def tensor_bytes(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """The bytes of the model's tensors and of its optimizers' state: a checkpoint's bulk."""
    total = sum(t.numel() * t.element_size() for t in pl_module.state_dict().values() if hasattr(t, "numel"))
    for opt in trainer.optimizers:
        for state in opt.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "numel"))
    return total


class PeriodicCheckpoint(ModelCheckpoint):
    def __init__(self, dirpath: str, every_n_steps: int = 0, every_minutes: float | None = 10.0,
                 after_validation: bool = True, keep: int = 1, max_overhead: float | None = 0.05):
        for name, value in (("every_n_steps", every_n_steps), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"callbacks.checkpoint.{name} must be an int >= 0, got {value!r}")
        if not isinstance(after_validation, bool):
            raise ValueError(f"callbacks.checkpoint.after_validation must be true or false, got {after_validation!r}")
        for name, value, top in (("every_minutes", every_minutes, float("inf")), ("max_overhead", max_overhead, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value <= top):
                raise ValueError(f"callbacks.checkpoint.{name} must be > 0{' and <= 1' if top == 1 else ''} or null, "
                                 f"got {value!r}")
        # monitor="step", mode="max": the newest `keep` saves are the top k (monitor=None allows k <= 1 only).
        # Lightning's own step trigger is off: the steps are one of this callback's triggers.
        super().__init__(dirpath=dirpath, filename="step{step}", auto_insert_metric_name=False,
                         monitor="step" if keep else None, mode="max", save_top_k=keep, save_last=True,
                         every_n_train_steps=0, every_n_epochs=0, enable_version_counter=False)
        self.every_n_steps, self.every_minutes = every_n_steps, every_minutes
        self.after_validation, self.max_overhead = after_validation, max_overhead
        self._clock = time.monotonic()  # when the last save let training go on
        self._cost = 0.0  # how long the last periodic save held training up, in seconds
        #: what this run's periodic saves cost (``overhead``): their number and the seconds they held training
        self.periodic_saves, self.held_s = 0, 0.0
        self._train_start = time.monotonic()
        self.overhead: dict | None = None

    @property
    def state_key(self) -> str:
        # Lightning's key holds the triggers: a resumed run with other ones would not get its
        # state back (the saves it keeps), and would leave the old ones undeleted
        return type(self).__name__

    def load_state_dict(self, state_dict: dict) -> None:
        """The saves the checkpoint names, in the directory that holds them: a run directory moved (or
        copied) after the save is still the same run, whose older step files ``keep`` prunes; a checkpoint resumed into another
        directory names files that are not there, and none is tracked (Lightning's own rule for another
        ``dirpath`` keeps only ``best_model_path``, and never prunes a moved directory's step files)."""
        saved = state_dict.get("dirpath", self.dirpath)
        if saved != self.dirpath:
            state_dict = {**state_dict, **self._found_here(state_dict), "dirpath": self.dirpath}
        super().load_state_dict(state_dict)

    def _found_here(self, state_dict: dict) -> dict:
        def here(path) -> str:
            moved = os.path.join(self.dirpath, os.path.basename(path)) if path else ""
            return moved if moved and os.path.isfile(moved) else ""

        best_k = {here(p): v for p, v in (state_dict.get("best_k_models") or {}).items() if here(p)}
        best, kth = here(state_dict.get("best_model_path")), here(state_dict.get("kth_best_model_path"))
        return {"best_k_models": best_k, "best_model_path": best, "kth_best_model_path": kth,
                "last_model_path": here(state_dict.get("last_model_path")),
                "best_model_score": state_dict.get("best_model_score") if best else None,
                "kth_value": state_dict.get("kth_value") if kth else self.kth_value}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # a resumed run writes into its own checkpoints: no news
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = self._train_start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        by_steps = self.every_n_steps > 0 and step % self.every_n_steps == 0 and step != self._last_global_step_saved
        if self._defer_save_until_validation:
            # Lightning defers an epoch's last save to a validation it expects (monitored
            # metrics): "step" is never stale, and that validation may not come
            self._defer_save_until_validation = False
            by_steps = True
        elapsed = time.monotonic() - self._clock
        by_time = self.every_minutes is not None and elapsed >= 60.0 * self.every_minutes
        if by_steps or self.every_minutes is not None:
            # rank 0's clock decides: every rank saves together
            due = by_steps or by_time
            if trainer.strategy.broadcast(due and self._within_budget(trainer, elapsed, pl_module)):
                self.save_now(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.after_validation and trainer.strategy.broadcast(
                self._within_budget(trainer, time.monotonic() - self._clock, pl_module)):
            self.save_now(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.overhead = self.measure_overhead(trainer)
        self.save_now(trainer, always=True)  # the final state, whatever the triggers

    def measure_overhead(self, trainer: pl.Trainer) -> dict:
        """The periodic saves' cost over the training's wall time, measured inside the run (the
        final save excluded): ``held_s``, the seconds they held training up; ``written_s``, from
        each save's start until it was on disk (the background write, which on few cores takes
        CPU from training; = held_s when saves are synchronous); ``share``, the larger over
        ``train_s``: what ``max_overhead`` bounds."""
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncAtomicCheckpointIO):
            io.wait()  # the last periodic save on disk: its write counted
        train_s = time.monotonic() - self._train_start
        written = io.total_save_s if isinstance(io, AsyncAtomicCheckpointIO) else self.held_s
        cost = max(self.held_s, written)
        return {"periodic_saves": self.periodic_saves, "held_s": round(self.held_s, 3), "written_s": round(written, 3),
                "train_s": round(train_s, 3), "share": round(cost / train_s, 4) if train_s > 0 else 0.0}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Only a preemption: another exception may leave a diverged or half-stepped state.
        if isinstance(exception, SIGTERMException):
            self.save_now(trainer, preempted=True, always=True)

    def _within_budget(self, trainer: pl.Trainer, elapsed: float, pl_module: pl.LightningModule | None = None) -> bool:
        """Whether the training since the last save pays for its cost within ``max_overhead``
        (before the first save, its cost estimated from the bytes to write)."""
        if self.max_overhead is None:
            return True
        written = getattr(trainer.strategy.checkpoint_io, "last_save_s", None)  # the background write, once on disk
        cost = max(self._cost, written or 0.0)
        if not self.periodic_saves and pl_module is not None:
            cost = max(cost, tensor_bytes(trainer, pl_module) / FIRST_SAVE_BYTES_PER_S)
        return elapsed * self.max_overhead >= cost

    def save_now(self, trainer: pl.Trainer, preempted: bool = False, always: bool = False) -> None:
        """step<N>.ckpt (kept among the newest ``keep``) and last.ckpt, unless this step is saved
        or (but when ``preempted``) an accumulation window is half done: its gradients are in
        no checkpoint, a time-triggered save waits for the window's optimizer step. ``always``
        (the end, SIGTERM): written before this returns (also when this step's periodic save,
        still in the background, is the one), and not counted as a periodic save."""
        io = trainer.strategy.checkpoint_io
        if self._should_skip_saving_checkpoint(trainer):  # not fitting, sanity check, or saved at this step
            if always and isinstance(io, AsyncAtomicCheckpointIO):
                io.wait()
            return
        if not preempted and trainer.state.stage == "train" and trainer.fit_loop.epoch_loop._should_accumulate():
            return
        start = time.monotonic()
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        if always and isinstance(io, AsyncAtomicCheckpointIO):
            io.wait()  # the SIGTERM save (and the last) is on disk when the run ends
        self._clock = time.monotonic()
        if not always:
            self._cost = self._clock - start
            self.periodic_saves += 1
            self.held_s += self._cost

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        saved = self._last_checkpoint_saved
        last = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        if not (saved and self._last_global_step_saved == trainer.global_step and saved != last
                and _is_local_file_protocol(last)):
            super()._save_last_checkpoint(trainer, monitor_candidates)  # no step file at this step
            return
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncAtomicCheckpointIO):
            # the step file is still being written: the link follows it in the writer thread
            # (where the file system has no hard links, a copy of the file)
            if trainer.is_global_zero:
                io.after_save(lambda: link_atomically(saved, last) or copy_atomically(saved, last))
            self.last_model_path = last
            return
        linked = link_atomically(saved, last) if trainer.is_global_zero else True
        if not trainer.strategy.broadcast(linked):  # no hard links on this file system: a copy
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        self.last_model_path = last

