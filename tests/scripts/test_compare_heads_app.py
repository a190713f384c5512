"""scripts/compare_heads_app.py: two tiny lst-train runs side by side, their rows, and
where they go."""
from __future__ import annotations

import csv

import compare_heads_app as cha
import pytest

# Six steps: the app times every 2nd step of experiment=tiny from step 4 on.
TINY = ["--heads", "factored", "softmax", "--steps", "6", "experiment=tiny", "data.max_eval_examples=64"]


def test_default_run_writes_its_run_directory_only(sandbox):
    run_dir = sandbox.run_default(cha.main, TINY, "compare_heads_app")
    csv_path = run_dir / f"app_heads_{cha.machine_name()}.csv"
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["head"] for r in rows] == ["factored", "softmax"]
    assert all(int(r["steps"]) == 6 and float(r["tokens_per_s"]) > 0 for r in rows)
    assert float(rows[0]["tokens_per_s_ratio"]) == 1.0
    assert float(rows[1]["tokens_per_s_ratio"]) == pytest.approx(
        float(rows[1]["tokens_per_s"]) / float(rows[0]["tokens_per_s"]))
    assert csv_path.with_suffix(".png").stat().st_size > 0


def test_update_results_writes_the_results_folder(sandbox):
    machine = cha.machine_name()
    changed = sandbox.run_update(cha.main, ["--heads", "softmax", "--steps", "6", *TINY[-2:]])
    assert changed == {f"app_heads_{machine}.csv", f"app_heads_{machine}.png"}
