"""scripts/mixed_precision_drift.py: bf16-mixed training of a user module stays close to fp32."""
from __future__ import annotations

import csv

import mixed_precision_drift as mpd


def test_bf16_mixed_user_module_stays_close_to_fp32(sandbox):
    args = ["--steps", "8", "--routes", "user_module", "--heads", "factored", "naive", "--losses", "zloss"]
    run_dir = sandbox.run_default(mpd.main, args, "mixed_precision_drift")
    with (run_dir / f"mixed_precision_drift_{mpd.machine_name()}.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["head"] for r in rows] == ["factored", "naive"]
    for r in rows:
        assert 0 < float(r["rel_diff_W"]) < 1e-3  # bf16 was used, and the head stayed close
        assert float(r["diff_over_update_W"]) < 0.1
