"""scripts/bench_sparse_exchange.py: two gloo ranks (forked from a fresh server) on tiny tables, torch's sparse
gradient and static rows; the bytes exchanged are the same for every D (the same rows touched)
and the rows go to the CSV of the run directory."""
from __future__ import annotations

import csv

import bench_sparse_exchange as bse
import pytest

TINY = ["--D", "300", "30000", "--d", "4", "--m", "6", "--context", "2", "--ids", "50", "--steps", "2",
        "--warmup", "1"]


def test_bytes_do_not_change_with_D(sandbox):
    run_dir = sandbox.run_default(bse.main, TINY, "bench_sparse_exchange")
    with (run_dir / f"bench_sparse_exchange_{bse.machine_name()}.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["gradient"], r["D"]) for r in rows] == [("coo", "300"), ("coo", "30000"), ("static", "300"),
                                                       ("static", "30000")]
    small, large, static_small, static_large = rows
    assert int(small["bytes_per_step"]) == int(large["bytes_per_step"]) > 0
    # coo: each rank gets every rank's padded (id, row) pairs of its distinct rows, and the counts
    assert int(small["bytes_per_step"]) == 2 * (8 + int(small["rows_touched_max"]) * (8 + 4 * 4))
    # static: every lookup's (id, row), m x context = 12 of them, and a count, in fixed shapes
    assert int(static_small["bytes_per_step"]) == int(static_large["bytes_per_step"]) == 2 * (13 * 8 + 12 * 4 * 4)
    assert int(large["dense_grad_bytes"]) == 100 * int(small["dense_grad_bytes"])


def test_one_process_is_refused(sandbox):
    with pytest.raises(SystemExit):
        bse.main([*TINY, "--world", "1"])


def test_update_results_adds_to_the_committed_csv(sandbox):
    name = f"bench_sparse_exchange_{bse.machine_name()}.csv"
    before = (sandbox.results / name).read_text().splitlines() if (sandbox.results / name).exists() else []
    assert sandbox.run_update(bse.main, TINY) == {name}
    after = (sandbox.results / name).read_text().splitlines()
    assert after[:len(before)] == before and len(after) == max(len(before), 1) + 4  # a header, four rows
