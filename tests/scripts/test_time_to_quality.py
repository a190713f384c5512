"""scripts/time_to_quality.py: the time a curve takes to reach a rival's MRR, a smoke pair of
lst-train runs side by side on the CPU clock, and where its rows go."""
from __future__ import annotations

import csv

import pytest

import time_to_quality as ttq


def test_time_to_reach_is_linear_between_validations_and_none_when_never_reached():
    pts = [{"clock_s": 10.0, "val_mrr": 0.2}, {"clock_s": 20.0, "val_mrr": 0.3}, {"clock_s": 30.0, "val_mrr": 0.4}]
    assert ttq.time_to_reach(pts, 0.35) == pytest.approx(25.0)
    assert ttq.time_to_reach(pts, 0.1) == 10.0  # reached at the first validation
    assert ttq.time_to_reach(pts, 0.4) == pytest.approx(30.0)
    assert ttq.time_to_reach(pts, 0.41) is None
    dip = [{"clock_s": 10.0, "val_mrr": 0.3}, {"clock_s": 20.0, "val_mrr": 0.2}, {"clock_s": 30.0, "val_mrr": 0.4}]
    assert ttq.time_to_reach(dip, 0.3) == 10.0  # the first time, not the last


def test_the_budget_and_the_validations_count_on_the_cpu_clock():
    words = ttq.overrides("python_code", "sampled_softmax", 2, "equal_time", 90, 6, 0)
    assert {"data=python_code", "clock=cpu", "+trainer.max_time=00:00:01:30", "trainer.val_check_interval=00:00:00:15",
            "seed=2", "cpu_threads=1", "head=sampled"} <= set(words)
    steps = ttq.overrides("synthetic_1e5", "softmax", 0, "same_steps", 0, 4, 1000)
    assert {"trainer.max_steps=1000", "trainer.val_check_interval=250", "head=softmax"} <= set(steps)
    assert not any(w.startswith("+trainer.max_time") for w in steps)


def test_a_variant_of_a_head_adds_its_settings_after_the_heads_own():
    words = ttq.overrides("python_code", "default_no_P;head.lr=8;loss.kwargs.mu=0.03", 0, "equal_time", 60, 6, 0)
    assert words[-3:] == ["head.preconditioner=null", "head.lr=8", "loss.kwargs.mu=0.03"]
    assert ttq.head_overrides("sampled_softmax") == ["head=sampled"]


def test_the_validation_size_recorded_is_the_last_override_as_hydra_takes_it():
    words = ttq.overrides("python_code", "default;data.max_eval_examples=4096", 0, "equal_time", 90, 6, 0)
    assert ttq.val_examples(words) == 4096
    assert ttq.val_examples(ttq.overrides("python_code", "default", 0, "equal_time", 90, 6, 0)) == 1024


@pytest.mark.slow  # two lst-train processes end to end (40 to 60 s); the rows' arithmetic is tested above
def test_a_smoke_pair_runs_side_by_side_and_writes_its_rows(sandbox):
    run_dir = sandbox.run_default(ttq.main, ["--smoke"], "time_to_quality")
    rows = list(csv.DictReader((run_dir / "time_to_quality.csv").open()))
    assert [r["head"] for r in rows] == ["default", "sampled_softmax"]
    assert [r["rival"] for r in rows] == ["sampled_softmax", "default"]
    for r in rows:
        assert r["clock"] == "cpu" and int(r["steps"]) > 0 and 0 < float(r["val_mrr"]) <= 1
        assert float(r["train_s"]) >= 3.0 and float(r["load_mean"]) >= 0
        assert r["command"].startswith("uv run lst-train ") and r["commit"] and r["torch"]
        # reach_ratio: the time to the rival's final MRR over the rival's own, where reached
        assert r["reach_ratio"] == "" or float(r["reach_ratio"]) == pytest.approx(
            float(r["reach_s"]) / float(next(o for o in rows if o is not r)["train_s"]), rel=0.01)
    curves = list(csv.DictReader((run_dir / "time_to_quality_curves.csv").open()))
    for head in ("default", "sampled_softmax"):
        mine = [c for c in curves if c["head"] == head]
        assert len(mine) >= 2 and [float(c["clock_s"]) for c in mine] == sorted(float(c["clock_s"]) for c in mine)


def test_update_results_appends_to_the_committed_csvs(sandbox, monkeypatch):
    def pair(case, heads, seed, budget, points, work, info, apart=False):
        row = {c: 1 for c in ttq.RUN_COLUMNS} | {"case": case, "head": heads[0], "seed": seed, **info, "command": "x"}
        return [row], [{c: 1 for c in ttq.CURVE_COLUMNS} | {"case": case, **info, "command": "x"}]

    monkeypatch.setattr(ttq, "equal_time_pair", pair)
    before = {name: len((sandbox.results / name).read_text().splitlines())
              for name in ("time_to_quality.csv", "time_to_quality_curves.csv")}
    changed = sandbox.run_update(ttq.main, ["--cases", "python_code", "--seeds", "0,1"])
    assert changed == set(before)
    for name, n in before.items():
        assert len((sandbox.results / name).read_text().splitlines()) == n + 2


def test_apart_runs_the_pair_one_after_the_other(tmp_path, monkeypatch):
    events = []
    monkeypatch.setattr(ttq, "launch", lambda words, run_dir: events.append(("launch", run_dir.name)) or run_dir.name)
    monkeypatch.setattr(ttq, "wait_all", lambda procs, dirs: events.append(("wait", *procs)) or [1.0])
    words, dirs = {"a": [], "b": []}, {"a": tmp_path / "a", "b": tmp_path / "b"}
    assert ttq.run_heads(words, dirs, apart=True) == [1.0, 1.0]
    assert events == [("launch", "a"), ("wait", "a"), ("launch", "b"), ("wait", "b")]
    events.clear()
    ttq.run_heads(words, dirs, apart=False)
    assert events == [("launch", "a"), ("launch", "b"), ("wait", "a", "b")]
