"""scripts/bench_checkpoints.py --smoke: tiny lst-train runs with and without periodic
checkpoints, their per-step times and the recompute cost, in the run directory (slow:
``uv run pytest -m slow tests/scripts/test_bench_checkpoints.py``)."""
from __future__ import annotations

import csv

import bench_checkpoints as bc
import pytest


@pytest.mark.slow  # four lst-train processes: about two minutes on the 2-core machine
def test_smoke_writes_a_row_per_setting(sandbox):
    run_dir = sandbox.run_default(bc.main, ["--smoke"], "bench_checkpoints")
    stem = run_dir / f"checkpoints_{bc.machine_name()}"
    rows = list(csv.DictReader(stem.with_suffix(".csv").open()))
    assert [(r["D"], r["setting"]) for r in rows] == [("300", "none"), ("300", "steps1000_async")]
    assert float(rows[0]["ratio_to_none"]) == 1.0 and float(rows[1]["ratio_to_none"]) > 0
    assert all(float(r["ckpt_mb"]) > 0 and float(r["recompute_s"]) > 0 for r in rows)
    assert int(rows[0]["recomputable_bytes"]) == 4 * (9 * 9 + 9 + 9 * 9)  # Q, wbar, U^-1 at d + 1 = 9, float32
    assert stem.with_suffix(".md").read_text().count("| 300 |") == 2 and stem.with_suffix(".png").stat().st_size > 0
