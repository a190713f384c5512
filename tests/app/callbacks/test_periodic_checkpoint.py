"""Checkpoints every n steps, every m minutes, after every validation, at the end and on
SIGTERM (periodic_checkpoint.py): the newest ``keep`` step files and last.ckpt, no more; a
periodic save waits until the training since the last one pays for its cost within
max_overhead; the SIGTERM save is on disk before the run stops."""
import threading
import types

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lst_lightning.app import checkpoint_io
from lst_lightning.app.callbacks import PeriodicCheckpoint, periodic_checkpoint
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of

TEN_STEPS = [*FAST, "trainer.limit_train_batches=10", "test=false", f"head._target_={'toy_heads.ToySoftmaxHead'}"]
EVERY_TRIGGER = [*TEN_STEPS, "callbacks.checkpoint.max_overhead=null"]  # no bound on the cost: every trigger saves


def saved(run_dir):
    return {p.name: torch.load(p, weights_only=True)["global_step"] for p in (run_dir / "checkpoints").glob("*.ckpt")}


def test_steps_validations_and_the_end_are_saved_and_the_newest_kept(tmp_path):
    run(cfg_of(*EVERY_TRIGGER, "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_steps=3",
               "callbacks.checkpoint.every_minutes=null", "callbacks.checkpoint.keep=2"), tmp_path / "a")
    # saved at 3, 4 (validation), 6, 8 (validation), 9, 10 (the end): the two newest kept
    assert saved(tmp_path / "a") == {"step9.ckpt": 9, "step10.ckpt": 10, "last.ckpt": 10}
    ckpts = tmp_path / "a" / "checkpoints"  # last.ckpt is the newest step file, not a second copy
    assert (ckpts / "last.ckpt").stat().st_ino == (ckpts / "step10.ckpt").stat().st_ino
    run(cfg_of(*EVERY_TRIGGER, "trainer.limit_val_batches=0", "callbacks.checkpoint.every_n_steps=0",
               "callbacks.checkpoint.every_minutes=1e-9", "callbacks.checkpoint.keep=0"), tmp_path / "b")
    assert saved(tmp_path / "b") == {"last.ckpt": 10}  # by time: every step, only last.ckpt kept
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").stat().st_nlink == 1  # no step file: written itself


def test_a_moved_run_directory_still_keeps_only_the_newest(tmp_path):
    """A run directory moved, then resumed there: its step file from before the move is pruned by keep=1
    as in place; a resume into another directory leaves the first directory's files as they are."""
    run(cfg_of(*TEN_STEPS), tmp_path / "a")
    assert saved(tmp_path / "a") == {"step10.ckpt": 10, "last.ckpt": 10}
    (tmp_path / "a").rename(tmp_path / "moved")
    run(cfg_of(*TEN_STEPS, "trainer.max_epochs=2", "ckpt_path=last"), tmp_path / "moved")
    assert saved(tmp_path / "moved") == {"step20.ckpt": 20, "last.ckpt": 20}
    ckpt = tmp_path / "moved" / "checkpoints" / "step20.ckpt"
    run(cfg_of(*TEN_STEPS, "trainer.max_epochs=3", f"ckpt_path={ckpt}"), tmp_path / "other")
    assert saved(tmp_path / "other") == {"step30.ckpt": 30, "last.ckpt": 30}
    assert saved(tmp_path / "moved") == {"step20.ckpt": 20, "last.ckpt": 20}


def test_saves_wait_until_training_pays_for_them(tmp_path, monkeypatch):
    """On a clock where a step takes 0.5 s and a save holds training up for 1 s, a step
    trigger at every step with max_overhead 0.5 saves only once 2 s of training followed the
    last save; the end is saved whatever."""
    clock = {"t": 0.0}
    monkeypatch.setattr(periodic_checkpoint, "time", types.SimpleNamespace(monotonic=lambda: clock["t"]))
    save = PeriodicCheckpoint._save_topk_checkpoint

    def slow_save(self, trainer, candidates):
        clock["t"] += 1.0
        save(self, trainer, candidates)

    monkeypatch.setattr(PeriodicCheckpoint, "_save_topk_checkpoint", slow_save)
    monkeypatch.setattr(PeriodicCheckpoint, "on_train_batch_start",
                        lambda *_: clock.update(t=clock["t"] + 0.5), raising=False)
    res = run(cfg_of(*TEN_STEPS, "trainer.limit_val_batches=0", "callbacks.checkpoint.every_n_steps=1",
                     "callbacks.checkpoint.every_minutes=null", "callbacks.checkpoint.max_overhead=0.5",
                     "callbacks.checkpoint.keep=10"), tmp_path)
    # step 1 saved (it costs 1 s), then after 2 s of training: steps 5 and 9; and the end, 10
    assert saved(tmp_path) == {"step1.ckpt": 1, "step5.ckpt": 5, "step9.ckpt": 9, "step10.ckpt": 10, "last.ckpt": 10}
    # measured inside the run: 3 periodic saves held training 3 s of the 8 s (10 steps of 0.5 s
    # + the saves; the final save excluded); their writes (the real clock) took less than that
    cost = res["checkpoints"]
    assert (cost["periodic_saves"], cost["held_s"], cost["train_s"], cost["share"]) == (3, 3.0, 8.0, 0.375)
    assert 0 < cost["written_s"] < 3.0


def test_a_background_write_counts_in_the_cost_of_a_save(tmp_path):
    """A save that held training 0.1 s but took 2 s to reach the disk (the writer thread)
    costs 2 s: at max_overhead 0.05 the next waits for 40 s of training, not 2 s."""
    def trainer(io):
        return types.SimpleNamespace(strategy=types.SimpleNamespace(checkpoint_io=io))
    cb = PeriodicCheckpoint(dirpath=str(tmp_path), max_overhead=0.05)
    cb._cost = 0.1
    assert cb._within_budget(trainer(object()), 2.0)  # a synchronous IO: the time it held training
    io = types.SimpleNamespace(last_save_s=2.0)
    assert not cb._within_budget(trainer(io), 10.0) and cb._within_budget(trainer(io), 40.0)
    assert cb._within_budget(trainer(types.SimpleNamespace(last_save_s=None)), 2.0)  # none on disk yet


def test_the_first_save_waits_for_its_estimated_cost(tmp_path, monkeypatch):
    """Before any save is timed, its cost is the checkpoint's bytes at FIRST_SAVE_BYTES_PER_S:
    with a rate that makes it 2 s and steps of 0.5 s, max_overhead 0.5 lets the first save
    come only after 4 s of training (step 8), not at the first trigger."""
    clock = {"t": 0.0}
    monkeypatch.setattr(periodic_checkpoint, "time", types.SimpleNamespace(monotonic=lambda: clock["t"]))
    monkeypatch.setattr(PeriodicCheckpoint, "on_train_batch_start",
                        lambda *_: clock.update(t=clock["t"] + 0.5), raising=False)
    real = periodic_checkpoint.tensor_bytes
    monkeypatch.setattr(periodic_checkpoint, "tensor_bytes", lambda trainer, module: seen.append(real(trainer, module))
                        or 2.0 * periodic_checkpoint.FIRST_SAVE_BYTES_PER_S)
    seen = []
    res = run(cfg_of(*TEN_STEPS, "trainer.limit_val_batches=0", "callbacks.checkpoint.every_n_steps=1",
                     "callbacks.checkpoint.every_minutes=null", "callbacks.checkpoint.max_overhead=0.5",
                     "callbacks.checkpoint.keep=10"), tmp_path)
    assert min(saved(tmp_path).values()) == 8 and res["checkpoints"]["periodic_saves"] >= 1  # then timed: 9 too
    assert seen and all(b > 0 for b in seen)  # the model's and the optimizers' tensors were counted


class SigtermAt(pl.Callback):
    """SIGTERM as Lightning records it, received during step ``at``: the run stops at its end."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer._signal_connector.received_sigterm = True


def test_the_sigterm_save_is_on_disk_before_the_run_stops(tmp_path, monkeypatch):
    """SIGTERM during step 6, whose periodic save is still being written in the background when
    Lightning stops the run: the SIGTERM save (that same step: not written twice) waits for it.
    The write of step 6 is held until the training thread waits for it, so a save that did not
    wait would find no step6.ckpt (and release it only at teardown)."""
    queued, released, seen = threading.Event(), threading.Event(), {}
    io = checkpoint_io.AsyncAtomicCheckpointIO
    write, save, wait, on_exception = (checkpoint_io.atomic_torch_save, io.save_checkpoint, io.wait,
                                       PeriodicCheckpoint.on_exception)

    def held_write(obj, path):
        if obj.get("global_step") == 6:
            released.wait(timeout=30)
        write(obj, path)

    def save_and_mark(self, checkpoint, path, storage_options=None):
        save(self, checkpoint, path, storage_options)
        if checkpoint["global_step"] == 6:
            queued.set()

    def wait_and_release(self):
        if queued.is_set():  # a wait for the save of step 6, once it is queued
            released.set()
        wait(self)

    def stopped(self, trainer, pl_module, exception):
        on_exception(self, trainer, pl_module, exception)
        seen.update(on_disk=(tmp_path / "checkpoints" / "step6.ckpt").is_file(),
                    sigterm=isinstance(exception, SIGTERMException))
    monkeypatch.setattr(checkpoint_io, "atomic_torch_save", held_write)
    monkeypatch.setattr(io, "save_checkpoint", save_and_mark)
    monkeypatch.setattr(io, "wait", wait_and_release)
    monkeypatch.setattr(PeriodicCheckpoint, "on_exception", stopped)
    with pytest.raises(SIGTERMException):
        run(cfg_of(*EVERY_TRIGGER, "trainer.limit_val_batches=0", "callbacks.checkpoint.every_n_steps=1",
                   "callbacks.checkpoint.every_minutes=null"), tmp_path, extra_callbacks=[SigtermAt(5)])
    assert seen == {"on_disk": True, "sigterm": True}
    assert saved(tmp_path) == {"step6.ckpt": 6, "last.ckpt": 6}


@pytest.mark.parametrize("bad,match", [({"every_n_steps": -1}, "every_n_steps must be an int >= 0"),
                                       ({"keep": True}, "keep must be an int >= 0"),
                                       ({"every_minutes": 0}, "every_minutes must be > 0 or null"),
                                       ({"max_overhead": 1.5}, "max_overhead must be > 0 and <= 1 or null"),
                                       ({"after_validation": "no"}, "after_validation must be true or false")])
def test_bad_settings_are_refused(tmp_path, bad, match):
    with pytest.raises(ValueError, match=f"callbacks.checkpoint.{match}"):
        PeriodicCheckpoint(str(tmp_path), **bad)
