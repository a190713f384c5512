"""Checkpoints every n steps, every m minutes, after every validation and at the end
(periodic_checkpoint.py): the newest ``keep`` step files and last.ckpt, no more."""
import pytest
import torch

from lst_lightning.app.callbacks import PeriodicCheckpoint
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of

TEN_STEPS = [*FAST, "trainer.limit_train_batches=10", "test=false", f"head._target_={'toy_heads.ToySoftmaxHead'}"]


def saved(run_dir):
    return {p.name: torch.load(p, weights_only=True)["global_step"] for p in (run_dir / "checkpoints").glob("*.ckpt")}


def test_steps_validations_and_the_end_are_saved_and_the_newest_kept(tmp_path):
    run(cfg_of(*TEN_STEPS, "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_steps=3",
               "callbacks.checkpoint.every_minutes=null", "callbacks.checkpoint.keep=2"), tmp_path / "a")
    # saved at 3, 4 (validation), 6, 8 (validation), 9, 10 (the end): the two newest kept
    assert saved(tmp_path / "a") == {"step9.ckpt": 9, "step10.ckpt": 10, "last.ckpt": 10}
    ckpts = tmp_path / "a" / "checkpoints"  # last.ckpt is the newest step file, not a second copy
    assert (ckpts / "last.ckpt").stat().st_ino == (ckpts / "step10.ckpt").stat().st_ino
    run(cfg_of(*TEN_STEPS, "trainer.limit_val_batches=0", "callbacks.checkpoint.every_n_steps=0",
               "callbacks.checkpoint.every_minutes=1e-9", "callbacks.checkpoint.keep=0"), tmp_path / "b")
    assert saved(tmp_path / "b") == {"last.ckpt": 10}  # by time: every step, only last.ckpt kept
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").stat().st_nlink == 1  # no step file: written itself


@pytest.mark.parametrize("bad,match", [({"every_n_steps": -1}, "every_n_steps must be an int >= 0"),
                                       ({"keep": True}, "keep must be an int >= 0"),
                                       ({"every_minutes": 0}, "every_minutes must be > 0 or null")])
def test_bad_settings_are_refused(tmp_path, bad, match):
    with pytest.raises(ValueError, match=f"callbacks.checkpoint.{match}"):
        PeriodicCheckpoint(str(tmp_path), **bad)
