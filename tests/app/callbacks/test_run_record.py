"""What a run records about itself (callbacks/run_record.py), read back from what W&B
wrote: one W&B run per job of a multirun, the facts as flat config keys, results.json's
numbers as the summary under the same names as the CSV log's columns, and a failed run
finished as failed."""
import csv
import json
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import WandbLogger

from lst_lightning.app.callbacks import RunRecord
from lst_lightning.app.machine import machine_name
from lst_lightning.app.run_keys import FACTS, summary_of
from lst_lightning.app.wandb_files import find_run_files, read_run, read_runs

WANDB_INTERNAL = {"_runtime", "_step", "_timestamp"}


def jobs(sweep):
    """(results.json, the CSV log's rows, the W&B run) of each job."""
    out = []
    for res in sorted(sweep.glob("*/results.json")):
        files = find_run_files(res.parent / "wandb")
        assert len(files) == 1, f"{res.parent}: {len(files)} W&B runs"
        rows = list(csv.DictReader((res.parent / "csv" / "metrics.csv").open()))
        out.append((json.loads(res.read_text()), rows, read_run(files[0])))
    return out


def test_each_job_of_a_multirun_is_its_own_finished_wandb_run(wandb_sweep, wandb_group):
    runs = read_runs(wandb_sweep)
    assert len(runs) == 2 and len({r.run_id for r in runs}) == 2
    assert {r.run_dir for r in runs} == {p.parent for p in wandb_sweep.glob("*/results.json")}
    assert all(r.state == "finished" and r.group == wandb_group for r in runs)  # one group per sweep
    # each run holds its own job's training only: 10 steps, not 20
    assert [r.summary["train_steps"] for r in runs] == [10, 10]
    assert {r.name for r in runs} == {"tiny[loss.kwargs.a=0.1]", "tiny[loss.kwargs.a=1]"}


def test_facts_are_flat_config_keys_and_in_results(wandb_sweep):
    for results, _, run in jobs(wandb_sweep):
        facts = {k: run.config[k] for k in FACTS}
        assert facts == {k: results[k] for k in FACTS}
        assert facts["a"] == run.config["loss.kwargs.a"] and facts["b"] == run.config["loss.kwargs.b"] == 10
        assert facts | {"a": None} == {
            "head": "FactoredSphericalHead", "loss": "zloss", "head_loss": "FactoredSphericalHead-zloss", "a": None,
            "b": 10, "lr": 0.002, "head_lr": 1.0, "D": results["num_classes"], "d": 16, "m": 32, "body": "NgramMLP",
            "machine": machine_name(gpu=False)}


def test_summary_holds_results_under_the_csv_names(wandb_sweep):
    for results, rows, run in jobs(wandb_sweep):
        flat = summary_of(results)
        assert {"test/top5_error", "unigram_test/top5_error", "step_time_ms", "tokens_per_s", "head_share", "wall_s",
                "head/folds", "head/cond_estimate"} <= flat.keys()
        assert {k: run.summary[k] for k in flat} == pytest.approx(flat)
        # what W&B's history holds, the CSV log holds under the same names (its step is W&B's trainer/global_step)
        logged = set().union(*run.history) - WANDB_INTERNAL - {"trainer/global_step"}
        assert logged == set(rows[0]) - {"step"}
        # the final counters, read at the end: the head stepped 10 times; its logs (every 5 steps) hold
        # the counters its device flags' last read took (every 4 steps)
        assert results["head/steps"] == run.summary["head/steps"] == 10
        assert [row["head/steps"] for row in run.history if "head/steps" in row] == [4]


def test_a_failed_run_is_finished_as_failed(tmp_path):
    logger = WandbLogger(save_dir=str(tmp_path), project="lst-test", name="fails", mode="offline")
    record = RunRecord({"head": "X"})
    trainer = SimpleNamespace(is_global_zero=True, loggers=[logger])
    record.setup(trainer, None, "fit")
    record.on_exception(trainer, None, FloatingPointError("diverged"))
    run = read_run(find_run_files(tmp_path)[0])
    assert run.state == "failed" and run.config["head"] == "X"
