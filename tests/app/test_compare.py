"""lst-compare's reading of run directories (compare.py): curves, best values, times, and clear errors."""
import csv
import json
from pathlib import Path

import pytest
import yaml

from lst_lightning.app.compare import compare, load_runs


def fake_run(root: Path, name: str, a: float, b: float, val_top5: list[float], test_top5: float) -> Path:
    d = root / name
    (d / "csv").mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({
        "name": name, "head": "FactoredSphericalHead", "loss": "zloss", "train_steps": 20,
        "val": {"top5_error": val_top5[-1]}, "test": {"top5_error": test_top5, "mrr": 0.3},
        "step_time_ms": 2.0}))
    (d / "config.yaml").write_text(yaml.safe_dump({"loss": {"name": "zloss", "kwargs": {"a": a, "b": b}}}))
    with (d / "csv" / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "step", "train/elapsed_s", "train/loss", "val/top5_error"])
        for i, v in enumerate(val_top5):
            step = 10 * (i + 1) - 1
            w.writerow([0, step, 0.5 * (i + 1), 5.0 - i, ""])
            w.writerow([0, step, "", "", v])  # Lightning's validation row: no elapsed time
    return d



def test_compare_reads_curves_best_values_and_times(tmp_path):
    fake_run(tmp_path / "sweep", "r1", 0.1, 5, [0.6, 0.4, 0.5], 0.45)
    fake_run(tmp_path / "sweep", "r2", 1.0, 5, [0.7, 0.65], 0.62)
    runs = {r.name: r for r in load_runs([tmp_path / "sweep"])}
    r1 = runs["r1"]
    assert r1.metric("best_val/top5_error") == 0.4  # the minimum over the curve, not the last
    assert r1.metric("val/top5_error") == 0.5
    assert r1.metric("loss.kwargs.a") == 0.1
    # validation points take the training time logged just before them
    assert [t for _, _, t in r1.curves["val/top5_error"]] == [0.5, 1.0, 1.5]
    assert [s for s, _, _ in r1.curves["train/loss"]] == [9.0, 19.0, 29.0]
    out = tmp_path / "out"
    res = compare([tmp_path / "sweep"], out, metric="best_val/top5_error")
    assert "heatmap.png" not in res["files"]  # one value of b: no heatmap
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert [r["run"] for r in rows] == ["r1", "r2"]
    assert float(rows[1]["best_val/top5_error"]) == 0.65



def test_compare_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no results.json"):
        compare([tmp_path], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no such run"):
        compare([tmp_path / "missing"], tmp_path / "out")
    fake_run(tmp_path, "r1", 0.1, 5, [0.5], 0.5)
    with pytest.raises(ValueError, match="in none of the runs"):
        compare([tmp_path], tmp_path / "out", metric="test/top3_error")
    assert not (tmp_path / "out").exists()  # nothing written on bad input
