"""scripts/quality_table.py: per-task overrides and the table it writes (no training here:
the runs themselves are lst-train runs, tested in test_app.py)."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "quality_table.py"


@pytest.fixture(scope="module")
def qt():
    spec = importlib.util.spec_from_file_location("quality_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_task_overrides_pick_the_task(qt):
    specs = ["wiki:trainer.limit_train_batches=150", "synthetic:data.num_classes=3000",
             "synthetic:trainer.check_val_every_n_epoch=2"]
    assert qt.task_overrides(specs, "wiki") == ["trainer.limit_train_batches=150"]
    assert qt.task_overrides(specs, "synthetic") == ["data.num_classes=3000", "trainer.check_val_every_n_epoch=2"]
    assert qt.task_overrides([], "wiki") == []


@pytest.mark.parametrize("bad", ["trainer.max_epochs=1", "lm1b:data.x=1", "wiki:"])
def test_task_overrides_reject_bad_specs(qt, bad):
    with pytest.raises(ValueError, match="TASK:OVERRIDE"):
        qt.task_overrides([bad], "wiki")


def test_write_results_writes_every_row_and_the_failures(qt, tmp_path, monkeypatch):
    monkeypatch.setattr(qt, "RESULTS", tmp_path)
    rows = [
        {"task": "wiki", "head": "softmax", "mode": "budget", "num_classes": 10, "train_steps": 5,
         "top10_error": 0.5, "top1_error": 0.9, "mrr": 0.2, "perplexity": 40.0, "wall_s": 1.0,
         "curve": [{"train_s": 0.5, "step": 2, "top10_error": 0.7}, {"train_s": 1.0, "step": 5, "top10_error": 0.5}]},
        {"task": "wiki", "head": "hsoftmax", "mode": "budget", "error": "RuntimeError: boom", "curve": []},
    ]
    md, stem = qt.write_results(rows, "top10_error", "test-machine")
    with open(stem.with_suffix(".csv")) as f:
        got = list(csv.DictReader(f))
    assert [r["head"] for r in got] == ["softmax", "hsoftmax"]
    assert got[0]["top10_error"] == "0.5" and got[0]["machine"] == "test-machine"
    assert got[1]["error"] == "RuntimeError: boom"
    # top-1 before top-10 in the columns, and the failed row's empty cells in the markdown
    header = md.splitlines()[2]
    assert header.index("top1_error") < header.index("top10_error")
    assert "| wiki | budget | hsoftmax |" in md
    assert stem.with_suffix(".png").stat().st_size > 0


def test_merge_keeps_the_rows_not_rerun(qt, tmp_path, monkeypatch):
    monkeypatch.setattr(qt, "RESULTS", tmp_path)
    curve = [{"train_s": 1.5, "step": 10, "top10_error": 0.4}]
    rows = [{"task": "wiki", "head": "adaptive", "mode": "epochs", "train_steps": 300, "top10_error": 0.614,
             "mrr": 0.24, "curve": curve},
            {"task": "synthetic", "head": "adaptive", "mode": "epochs", "train_steps": 100, "top10_error": 0.9,
             "curve": []}]
    qt.write_results(rows, "top10_error", "m")
    kept = qt.previous_rows("m", {("synthetic", "epochs", "adaptive"), ("wiki", "budget", "adaptive")})
    assert len(kept) == 1
    (row,) = kept
    assert row["task"] == "wiki" and row["train_steps"] == 300 and row["top10_error"] == pytest.approx(0.614)
    assert row["curve"] == curve and "perplexity" not in row
    assert qt.previous_rows("other-machine", set()) == []
