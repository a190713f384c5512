"""scripts/bench_samplers.py: a tiny run's rows and where they go."""
from __future__ import annotations

import csv

import bench_samplers as bs
import pytest

TINY = ["--sizes", "64", "256", "--reps", "1", "--rows", "2", "--samples", "4", "--d-rff", "8", "--hidden-dim", "4"]


@pytest.mark.parametrize("kernel", ["rff", "quadratic"])
def test_default_run_writes_its_run_directory_only(sandbox, kernel):
    run_dir = sandbox.run_default(bs.main, [*TINY, "--kernel", kernel], "bench_samplers")
    csv_path = run_dir / f"bench_samplers_{kernel}_{bs.machine_name()}.csv"
    rows = list(csv.DictReader(csv_path.open()))
    assert [int(r["n"]) for r in rows] == [64, 256]
    for r in rows:
        assert r["kernel"] == kernel and r["machine"] == bs.machine_name()
        # the CSV rounds each to 3 decimals: the ratio of the rounded times is off by at most that
        direct, tree = float(r["direct_ms"]), float(r["tree_ms"])
        slack = 5e-4 * (1 + direct / tree) / max(tree - 5e-4, 1e-9) + 5e-4
        assert float(r["direct_over_tree"]) == pytest.approx(direct / tree, abs=slack)
    assert csv_path.with_suffix(".png").stat().st_size > 0


def test_update_results_writes_the_results_folder(sandbox):
    machine = bs.machine_name()
    assert sandbox.run_update(bs.main, TINY) == {f"bench_samplers_rff_{machine}.csv",
                                                 f"bench_samplers_rff_{machine}.png"}
