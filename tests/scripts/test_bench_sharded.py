"""scripts/bench_sharded.py: tiny runs in one process (and over two, slow), their rows,
and where they go: rows are added to the CSV of the output folder."""
from __future__ import annotations

import csv

import bench_sharded as bsh
import pytest

TINY = ["--D", "500", "--d", "8", "--m", "4", "--steps", "2", "--warmup", "1"]


def read(path):
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_default_run_writes_its_run_directory_only(sandbox):
    run_dir = sandbox.run_default(bsh.main, [*TINY, "--world", "1"], "bench_sharded")
    (row,) = read(run_dir / f"bench_sharded_{bsh.machine_name()}.csv")
    assert (row["D"], row["world"], row["global_batch"], row["comm_mb_per_step"]) == ("500", "1", "4", "0.0")
    assert float(row["step_ms"]) > 0


def test_runs_add_rows_to_the_folder_csv(sandbox, tmp_path):
    for D in ("300", "500"):
        bsh.main([*TINY, "--world", "1", "--D", D, "--out", str(tmp_path / "mine")])
    path = tmp_path / "mine" / f"bench_sharded_{bsh.machine_name()}.csv"
    assert [r["D"] for r in read(path)] == ["300", "500"]  # one header, both rows


def test_update_results_adds_to_the_committed_csv(sandbox):
    name = f"bench_sharded_{bsh.machine_name()}.csv"
    before = read(sandbox.results / name) if (sandbox.results / name).exists() else []
    assert sandbox.run_update(bsh.main, [*TINY, "--world", "1"]) == {name}
    rows = read(sandbox.results / name)
    assert rows[:len(before)] == before and len(rows) == len(before) + 1


@pytest.mark.slow
def test_two_spawned_ranks_against_one_process(sandbox):
    run_dir = sandbox.run_default(bsh.main, [*TINY, "--world", "2", "--single"], "bench_sharded")
    rows = read(run_dir / f"bench_sharded_{bsh.machine_name()}.csv")
    assert [(r["world"], r["global_batch"]) for r in rows] == [("1", "4"), ("2", "8")]
    assert float(rows[1]["comm_mb_per_step"]) > 0
