"""The loggers and callbacks from config (wiring.py): the _target_ entries of the logger and
callbacks groups, made in order by one loop; the keys users type still switch them."""
import shutil

import lightning.pytorch as pl
import pytest
import torch

from lst_lightning.app.callbacks import (FailTogether, HeadTiming, PeriodicCheckpoint, ProgressBar, ProgressLog,
                                         ResumeState, ShardedHeadCheckpoint)
from lst_lightning.app.csv_log import AppendingCSVLogger
from lst_lightning.app.wiring import Run, instantiate_group, model_checkpoint

from app_configs import cfgs_of


def made(group, tmp_path, cfg, loggers=()):
    return instantiate_group(cfg[group], Run(cfg, tmp_path, "run", "zloss", object(), None, None, list(loggers)))


def test_logger_keys_switch_the_loggers(tmp_path):
    csv, no_csv, offline = cfgs_of(["logger=csv"], ["logger=csv", "logger.csv=false"],
                                   ["logger=offline", "logger.wandb.group=g"])
    assert [type(x) for x in made("logger", tmp_path, csv)] == [AppendingCSVLogger]
    assert made("logger", tmp_path, no_csv) == []
    loggers = made("logger", tmp_path, offline)
    assert [type(x) for x in loggers] == [AppendingCSVLogger, pl.loggers.WandbLogger]


def test_a_resumed_run_continues_its_directorys_wandb_run(tmp_path):
    """ckpt_path=last/auto (or one of the directory's own checkpoints): the directory's newest W&B run id,
    whose offline parts `wandb sync` uploads as one run; a fresh start, or a resume into another
    directory, a new W&B run."""
    for name in ("offline-run-20260101_090000-older1", "offline-run-20260102_090000-abc123"):
        (tmp_path / "wandb" / name).mkdir(parents=True)
        (tmp_path / "wandb" / name / f"run-{name[-6:]}.wandb").write_bytes(b"")
    (tmp_path / "checkpoints").mkdir()
    torch.save({}, tmp_path / "checkpoints" / "last.ckpt")
    last, auto, own, elsewhere, fresh = cfgs_of(*[["logger=offline", o] for o in (
        "ckpt_path=last", "ckpt_path=auto", f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
        f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}", "ckpt_path=null")])
    assert [made("logger", tmp_path, c)[-1].version for c in (last, auto, own)] == ["abc123"] * 3
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "wandb", other / "wandb")  # an earlier run that saved no checkpoint
    assert made("logger", other, elsewhere)[-1].version is None
    assert made("logger", other, fresh)[-1].version is None


@pytest.mark.parametrize("name", ["default", "minimal"])
def test_callback_keys_reach_the_callbacks(tmp_path, name):
    (cfg,) = cfgs_of([f"callbacks={name}", "callbacks.progress_every=7", "~callbacks.run_record",
                      "metrics.timing_every=3", "head_checkpoint=per_rank"])
    cbs = made("callbacks", tmp_path, cfg, loggers=[object()])
    kinds = [type(c) for c in cbs]
    assert kinds[:6] == [PeriodicCheckpoint, ResumeState, FailTogether, HeadTiming, ProgressLog, ShardedHeadCheckpoint]
    assert cbs[0].dirpath == str(tmp_path / "checkpoints") and cbs[3].every == 3 and cbs[4].every == 7
    assert (ProgressBar in kinds) == (pl.callbacks.LearningRateMonitor in kinds) == (name == "default")
    assert made("callbacks", tmp_path, cfg, loggers=[])[-1].__class__ is not pl.callbacks.LearningRateMonitor


def test_checkpoints_written_in_the_background_or_not_nothing_else(tmp_path):
    """callbacks.checkpoint.asynchronous is true or false; anything else is refused in one line."""
    run = Run(None, tmp_path, "run", "zloss", object(), None, None, [])
    kw = dict(every_n_steps=0, every_minutes=10, after_validation=True, keep=1, max_overhead=0.05)
    assert isinstance(model_checkpoint(run, asynchronous=False, **kw), PeriodicCheckpoint)
    with pytest.raises(ValueError, match="callbacks.checkpoint.asynchronous must be true or false, got 'no'"):
        model_checkpoint(run, asynchronous="no", **kw)
