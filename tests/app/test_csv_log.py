"""No run loses its CSV log: every trainer config that runs on CPU keeps the train,
validation and test rows in csv/metrics.csv (trainer=ddp_cpu starts new workers, and
so a new writer, for every trainer call)."""
import csv
import shutil
from functools import partial

import pytest

from lst_lightning.app.csv_log import AppendingCSVLogger

from app_configs import FAST, cfg_of, group, lst_train, run_of
from forked_ranks import in_fresh_process

CPU_TRAINERS = [t for t in group("trainer") if cfg_of(f"trainer={t}").trainer.accelerator == "cpu"]
#: trainer configs whose launcher re-runs the command line for the other ranks (Lightning's
#: ModelParallelStrategy): run as a user types them, in a process of their own, not in pytest's
RELAUNCHING = {t for t in CPU_TRAINERS if cfg_of(f"trainer={t}").trainer.get("strategy") == "fsdp2"}


def rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_new_writer_keeps_the_rows_of_the_last_one(tmp_path):
    first = AppendingCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    first.log_metrics({"train/loss": 2.5}, step=3)
    first.save()
    second = AppendingCSVLogger(save_dir=str(tmp_path), name="csv", version="")  # a new process's logger
    second.log_metrics({"train/loss": 2.0}, step=5)
    second.log_metrics({"test/mrr": 0.25}, step=5)  # a new column: the file is rewritten
    second.save()
    got = rows(tmp_path / "csv" / "metrics.csv")
    assert [(r["step"], r["train/loss"], r["test/mrr"]) for r in got] == [("3", "2.5", ""), ("5", "2.0", ""),
                                                                         ("5", "", "0.25")]


def test_the_cpu_trainers_are_found():
    assert {"cpu", "ddp_cpu"} <= set(CPU_TRAINERS)


TINY = [*FAST, "trainer.limit_train_batches=8", "trainer.log_every_n_steps=2", "data.max_eval_examples=64",
        "metrics.timing_every=0"]


def run_keeps_its_rows(tmp_path, *overrides, launch=run_of):
    """Tiny run: 8 steps, validation at the end of the epoch, the test split (``launch``: how run
    is called, ``in_fresh_process`` where the trainer forks its ranks)."""
    launch([*TINY, "head=softmax", *overrides], tmp_path)
    assert_rows(tmp_path)


def assert_rows(tmp_path):
    got = rows(tmp_path / "csv" / "metrics.csv")
    train = [r for r in got if r.get("train/loss")]
    assert len(train) >= 2, got  # a curve, not a point
    assert any(r.get("val/top5_error") for r in got), got
    assert any(r.get("test/top5_error") for r in got), got
    # after training, at its last step: workers started per trainer call log there too (not at step 0)
    last = max(int(r["step"]) for r in train)
    assert all(int(r["step"]) >= last for r in got if r.get("test/top5_error") or r.get("val/top5_error")), got


# ddp_cpu's spawned workers re-import torch for each trainer call (minutes on a loaded
# 2-core machine): the shipped config runs with the slow tests; ddp_fork starts its workers
# the same way, a new logger writer per trainer call, in seconds.
@pytest.mark.parametrize("trainer", [pytest.param(t, marks=pytest.mark.slow) if t == "ddp_cpu" else t
                                     for t in CPU_TRAINERS if t not in RELAUNCHING])
def test_every_cpu_trainer_keeps_train_val_and_test_rows(tmp_path, trainer):
    run_keeps_its_rows(tmp_path, f"trainer={trainer}")


@pytest.mark.slow  # two processes that each import torch and Lightning, as ddp_cpu's
@pytest.mark.parametrize("trainer", sorted(RELAUNCHING))
def test_a_trainer_that_relaunches_its_command_keeps_the_rows(tmp_path, trainer):
    """trainer=fsdp2_cpu (the body sharded by FSDP2, the head replicated) run as lst-train."""
    lst_train(*TINY, f"trainer={trainer}", "head.parallel=replicated", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert_rows(tmp_path)


@pytest.mark.slow  # forked ranks through a fresh process
def test_workers_started_per_trainer_call_keep_the_rows(tmp_path):
    run_keeps_its_rows(tmp_path, "trainer=ddp_cpu", "trainer.strategy=ddp_fork", launch=partial(in_fresh_process, run_of))


def test_a_fresh_run_in_an_earlier_runs_directory_begins_its_log_anew(tmp_path):
    """A sweep run again into its directory (a fixed hydra.sweep.dir), without ckpt_path, its
    checkpoints deleted (a fresh start among them is refused: resume.py): each job's metrics.csv
    holds the new run's rows only (lst-compare's curves and best values read it); a resumed run
    still continues it."""
    run_of([*TINY, "head=softmax"], tmp_path)
    first = rows(tmp_path / "csv" / "metrics.csv")
    shutil.rmtree(tmp_path / "checkpoints")
    # the save after the epoch's validation (mid-epoch: its 4 of 8 batches) made whatever it costs: a
    # save within the time budget only is made or skipped by the machine's speed, and when skipped
    # last.ckpt is the end of training's, its epoch done, which a resume has nothing left of
    run_of([*TINY, "head=softmax", "trainer.limit_train_batches=4", "callbacks.checkpoint.max_overhead=null"],
           tmp_path)
    got = rows(tmp_path / "csv" / "metrics.csv")
    assert max(int(r["step"]) for r in first) > 4
    assert max(int(r["step"]) for r in got) <= 4, got  # none of the first run's 8 steps
    assert sum(bool(r.get("test/top5_error")) for r in got) == 1
    run_of([*TINY, "head=softmax", "ckpt_path=last"], tmp_path)  # resumed from step 4 to 8: appended
    resumed = rows(tmp_path / "csv" / "metrics.csv")
    assert resumed[:len(got)] == got and max(int(r["step"]) for r in resumed) > 4
