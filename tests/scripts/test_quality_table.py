"""scripts/quality_table.py: per-task overrides, the table it writes, where it writes it,
and --merge (tiny lst-train runs: the app itself is tested in tests/app)."""
from __future__ import annotations

import csv
import json
import time
from types import SimpleNamespace

import pytest
import quality_table as qt
import results_pages as rp


def tiny(head: str = "adaptive") -> list[str]:
    """One head, one task, one mode, a few steps: seconds."""
    return ["--preset", "quick", "--tasks", "wiki", "--heads", head, "--modes", "epochs",
            "-o", "trainer.limit_train_batches=3", "-o", "data.max_eval_examples=64"]


def read(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow  # a run of its own (35 s); the --update-results run below writes the same files
def test_default_run_writes_its_run_directory_only(sandbox):
    run_dir = sandbox.run_default(qt.main, tiny(), "quality_table")
    stem = run_dir / f"quality_table_{qt.machine_name()}"
    (row,) = read(stem.with_suffix(".csv"))  # no committed rows merged in
    assert (row["task"], row["mode"], row["head"], row["train_steps"]) == ("wiki", "epochs", "adaptive", "3")
    (line,) = [r for r in stem.with_suffix(".md").read_text().splitlines() if r.startswith("| wiki | epochs |")]
    assert "| adaptive |" in line  # the table's row (its budget's columns empty in epochs mode)
    assert stem.with_suffix(".png").stat().st_size > 0
    assert (stem.parent / (stem.name + "_curves.json")).exists()


def test_a_failed_run_keeps_the_others_rows_and_exits_1(sandbox, monkeypatch, tmp_path):
    """One head's run raising leaves its row with the error and the other heads' rows; the exit
    status is 1 (the GPU suite's summary then shows the step failed), 0 when every run ran."""
    def run_apart(task, head, mode, args, out_dir):
        if head == "softmax":
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")
        return {"task": task, "head": head, "mode": mode, "num_classes": 10, "train_steps": 3, "mrr": 0.1, "curve": []}

    monkeypatch.setattr(qt, "run_apart", run_apart)
    out = ["--tasks", "wiki", "--modes", "epochs", "--out", str(tmp_path)]
    assert qt.main([*out, "--heads", "adaptive", "softmax"]) == 1
    rows = {r["head"]: r for r in read(tmp_path / f"quality_table_{qt.machine_name()}.csv")}
    assert rows["adaptive"]["train_steps"] == "3" and "CUDAGraphs" in rows["softmax"]["error"]
    assert qt.main([*out, "--heads", "adaptive"]) == 0


def test_merge_needs_a_folder_to_merge_with(sandbox):
    with pytest.raises(SystemExit):
        qt.main([*tiny(), "--merge"])
    assert not (sandbox.cwd / "outputs").exists()


@pytest.mark.slow  # the benchmark's bookkeeping, not the heads': a quick table run, about 13 s
def test_update_results_merge_replaces_only_the_rows_rerun(sandbox):
    """This machine's table in the (sandboxed) results folder, one row the run leaves alone and
    one it redoes (marked): --merge keeps the first and replaces the second."""
    csv_name = f"quality_table_{qt.machine_name()}.csv"
    row = dict(task="wiki", mode="epochs", num_classes=10000, train_steps=999, top1_error=0.9, top10_error=0.7,
               mrr=0.1, curve=[])
    qt.write_results([{**row, "head": "softmax"}, {**row, "head": "adaptive"}], "top10_error", qt.machine_name(),
                     sandbox.results)
    committed = read(sandbox.results / csv_name)
    changed = sandbox.run_update(qt.main, [*tiny(), "--merge"])
    assert csv_name in changed
    rows = read(sandbox.results / csv_name)
    key = lambda r: (r["task"], r["mode"], r["head"])  # noqa: E731
    rerun = ("wiki", "epochs", "adaptive")
    assert sorted(map(key, rows)) == sorted(map(key, committed))
    filled = lambda r: {k: v for k, v in r.items() if v != ""}  # noqa: E731  (the new run brings more columns)
    assert [filled(r) for r in rows if key(r) != rerun] == [filled(r) for r in committed if key(r) != rerun]
    assert next(r for r in rows if key(r) == rerun)["train_steps"] == "3"


@pytest.mark.slow  # the same merge into --out (two runs, 25 s)
def test_merge_with_an_earlier_run_in_out(sandbox, tmp_path):
    out = ["--out", str(tmp_path / "table")]
    qt.main([*tiny(), *out])
    qt.main([*tiny("softmax"), *out, "--merge"])
    rows = read(tmp_path / "table" / f"quality_table_{qt.machine_name()}.csv")
    assert [r["head"] for r in rows] == ["adaptive", "softmax"]


def test_task_overrides_pick_the_task():
    specs = ["wiki:trainer.limit_train_batches=150", "synthetic:data.num_classes=3000",
             "synthetic:trainer.check_val_every_n_epoch=2"]
    assert qt.task_overrides(specs, "wiki") == ["trainer.limit_train_batches=150"]
    assert qt.task_overrides(specs, "synthetic") == ["data.num_classes=3000", "trainer.check_val_every_n_epoch=2"]
    assert qt.task_overrides([], "wiki") == []


@pytest.mark.parametrize("bad", ["trainer.max_epochs=1", "lm1b:data.x=1", "wiki:"])
def test_task_overrides_reject_bad_specs(bad):
    with pytest.raises(ValueError, match="TASK:OVERRIDE"):
        qt.task_overrides([bad], "wiki")


def test_write_results_writes_every_row_and_the_failures(tmp_path):
    rows = [
        {"task": "wiki", "head": "softmax", "mode": "budget", "budget_s": 60.0, "clock": "train", "num_classes": 10,
         "train_steps": 5,
         "top10_error": 0.5, "top1_error": 0.9, "mrr": 0.2, "perplexity": 40.0, "wall_s": 1.0,
         "curve": [{"train_s": 0.5, "step": 2, "top10_error": 0.7}, {"train_s": 1.0, "step": 5, "top10_error": 0.5}]},
        {"task": "wiki", "head": "hsoftmax", "mode": "budget", "budget_s": 60.0, "clock": "train",
         "error": "RuntimeError: boom", "curve": []},
    ]
    md, stem = qt.write_results(rows, "top10_error", "test-machine", tmp_path)
    with open(stem.with_suffix(".csv")) as f:
        got = list(csv.DictReader(f))
    assert [r["head"] for r in got] == ["softmax", "hsoftmax"]
    assert got[0]["top10_error"] == "0.5" and got[0]["machine"] == "test-machine"
    assert got[1]["error"] == "RuntimeError: boom"
    # top-1 before top-10 in the columns, and the failed row's empty cells in the markdown
    header = md.splitlines()[2]
    assert header.index("top1_error") < header.index("top10_error")
    assert "| wiki | budget | 60 | train | hsoftmax |" in md
    assert stem.with_suffix(".png").stat().st_size > 0


def test_previous_rows_keep_the_rows_not_rerun(tmp_path):
    curve = [{"train_s": 1.5, "step": 10, "top10_error": 0.4}]
    rows = [{"task": "wiki", "head": "adaptive", "mode": "epochs", "train_steps": 300, "top10_error": 0.614,
             "mrr": 0.24, "curve": curve},
            {"task": "synthetic", "head": "adaptive", "mode": "epochs", "train_steps": 100, "top10_error": 0.9,
             "curve": []}]
    qt.write_results(rows, "top10_error", "m", tmp_path)
    kept = qt.previous_rows(tmp_path, "m", {("synthetic", "epochs", "adaptive"), ("wiki", "budget", "adaptive")})
    assert len(kept) == 1
    (row,) = kept
    assert row["task"] == "wiki" and row["train_steps"] == 300 and row["top10_error"] == pytest.approx(0.614)
    assert row["curve"] == curve and "perplexity" not in row
    assert qt.previous_rows(tmp_path, "other-machine", set()) == []


def test_duration_is_lightnings_time_string():
    assert qt.duration(30) == "00:00:00:30"
    assert qt.duration(3725.9) == "00:01:02:05"
    assert qt.duration(0.2) == "00:00:00:01"  # Lightning refuses a zero interval


def test_train_clock_budget_stops_after_training_time_only(monkeypatch):
    """--budget-clock train: validation time does not count against the budget."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    trainer = SimpleNamespace(should_stop=False, sanity_checking=False, callback_metrics={}, global_step=0,
                              state=SimpleNamespace(fn="fit"), strategy=SimpleNamespace(broadcast=lambda x: x))
    curve = qt.ValidationCurve(budget_s=10.0)
    curve.on_train_start(trainer, None)
    now[0] = 6.0
    curve.on_train_batch_end(trainer, None, None, None, 0)
    curve.on_validation_start(trainer, None)
    now[0] = 106.0  # a slow validation
    curve.on_validation_end(trainer, None)
    curve.on_train_batch_end(trainer, None, None, None, 1)
    assert not trainer.should_stop and curve.points[0]["train_s"] == 6.0
    now[0] = 110.0
    curve.on_train_batch_end(trainer, None, None, None, 2)
    assert trainer.should_stop


def test_train_clock_is_the_schedules_clock(monkeypatch):
    """--budget-clock train: the app's schedule (scheduler.over=budget) reads the same clock,
    so the lr decays over the training seconds; a slow validation does not count."""
    from lst_lightning.app.module import time_spent  # noqa: PLC0415

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    trainer = SimpleNamespace(sanity_checking=False, callback_metrics={}, global_step=0, state=SimpleNamespace(fn="fit"))
    curve = qt.ValidationCurve(budget_s=10.0)
    assert time_spent(curve) == 0.0
    curve.on_train_start(trainer, None)
    now[0] = 4.0
    curve.on_validation_start(trainer, None)
    now[0] = 50.0  # a slow validation
    curve.on_validation_end(trainer, None)
    now[0] = 55.0
    assert time_spent(curve) == pytest.approx(0.9)
    assert time_spent(qt.ValidationCurve()) == 0.0  # --budget-clock wall: Lightning's own Timer is the budget


@pytest.mark.slow  # lst-train runs with timed validation
def test_budget_on_the_train_clock_with_timed_validation(sandbox, tmp_path):
    out = tmp_path / "large"
    qt.main(["--preset", "quick", "--tasks", "wiki", "--heads", "softmax", "--modes", "budget", "--budget-s", "2",
             "--budget-clock", "train", "--val-every-s", "1", "--stem", "quality_large_D", "-o",
             "data.max_eval_examples=64", "--out", str(out)])
    (row,) = read(out / f"quality_large_D_{qt.machine_name()}.csv")
    assert row["mode"] == "budget" and not row.get("error") and int(row["train_steps"]) > 0
    assert (float(row["budget_s"]), row["clock"]) == (2.0, "train")  # recordable: quality.csv's columns
    tidy = csv.DictReader((rp.DATA / "quality.csv").open()).fieldnames
    assert {c for c in tidy if c not in rp.META} <= set(row), set(tidy) - set(row)
    curve = json.loads((out / f"quality_large_D_{qt.machine_name()}_curves.json").read_text())[0]
    times = [p["train_s"] for p in curve["curve"]]
    assert len(times) >= 2 and times == sorted(times) and times[-1] >= 2.0


@pytest.mark.slow  # a spawned process that imports the app, about 13 s
def test_each_run_has_a_process_of_its_own(sandbox, monkeypatch, tmp_path):
    """run_apart runs run_one in a fresh process (each run starts with the memory free): what
    this process changes, here its ``run`` made to fail, does not reach it."""
    def broken(*a, **k):
        raise AssertionError("ran in the calling process")

    monkeypatch.setattr(qt, "run", broken)
    args = SimpleNamespace(
        val_every=0, val_every_s=0.0, epochs=1, budget_s=1.0, budget_clock="wall", max_epochs_in_budget=1,
        preset="quick", override=["trainer.limit_train_batches=2", "data.max_eval_examples=32"],
        task_override=[], seed=0)
    row = qt.run_apart("wiki", "adaptive", "epochs", args, tmp_path)
    assert row["train_steps"] == 2 and row["head"] == "adaptive"
