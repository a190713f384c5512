"""scripts/bench_step_cpu.py: the two steps side by side at a small size, each timed and counted."""
from __future__ import annotations

import csv

import bench_step_cpu as bs


def test_it_prints_both_steps_and_their_ratio_and_writes_their_rows(capsys, tmp_path):
    assert bs.main(["--D", "300", "--d", "8", "--m", "8", "--steps", "10", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("default", "sampled_softmax"):
        line = next(x for x in lines if x.strip().startswith(f"{name}:"))
        assert "ms/step" in line and "op calls/step profiled" in line
    assert any(x.startswith("default / sampled_softmax: ") for x in lines)
    rows = list(csv.DictReader((tmp_path / "step_cpu.csv").open()))
    assert [r["head"] for r in rows] == ["default", "sampled_softmax"]
    assert all(r["machine"] and r["torch"] and r["date"] and int(r["ops_profiled"]) > 0 for r in rows)
    assert float(rows[1]["over_sampled_softmax"]) == 1.0
