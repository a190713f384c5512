"""scripts/bench_head_cpu.py: the smoke run's rows and where they go, and the ratio arithmetic."""
from __future__ import annotations

import csv

import bench_head_cpu as hc
import benchlib
import pytest
import torch


def test_default_run_writes_its_run_directory_only(sandbox):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the default is one thread whatever torch would take
    try:
        run_dir = sandbox.run_default(hc.main, ["--smoke", "--reps", "2"], "bench_head_cpu")
    finally:
        torch.set_num_threads(threads)
    machine = hc.machine_name()
    csv_path = run_dir / f"head_cpu_smoke_{machine}.csv"
    assert csv_path.with_suffix(".png").stat().st_size > 0
    rows = list(csv.DictReader(csv_path.open()))
    expected = [(c["group"], impl, str(c["D"])) for c in hc.CONFIGS["smoke"] for impl in c["impls"]
                if not hc.missing(impl)]  # (F.linear_cross_entropy: torch 2.13 on)
    assert [(r["group"], r["impl"], r["D"]) for r in rows] == expected
    assert all(r["machine"] == machine and float(r["ms"]) > 0 for r in rows)
    assert set(rows[0]) >= {"torch", "threads"} and {r["run"] for r in rows} == {"smoke"}
    assert {r["threads"] for r in rows} == {"1"}  # one torch thread by default, as every script (docs/benchmarks.md)
    # every column of the committed tidy CSV that results_pages.py's ``add`` appends these rows to
    with (benchlib.ROOT / "benchmarks" / "results" / "head_step_cpu.csv").open() as fh:
        assert set(next(csv.reader(fh))) - {"command"} <= set(rows[0])


def test_update_results_writes_the_results_folder(sandbox):
    changed = sandbox.run_update(hc.main, ["--smoke", "--reps", "1"])
    machine = hc.machine_name()
    assert changed == {f"head_cpu_smoke_{machine}.csv", f"head_cpu_smoke_{machine}.png"}


def test_full_and_smoke_exclude_each_other(sandbox):
    with pytest.raises(SystemExit):
        hc.main(["--full", "--smoke"])


def test_ratios_within_groups_and_flatness():
    cfgs = hc.CONFIGS["full"]
    rows = [dict(group="vs_linear_cross_entropy", impl="factored", D=500_000, ms=10.0),
            dict(group="vs_linear_cross_entropy", impl="linear_cross_entropy", D=500_000, ms=5000.0),
            dict(group="vs_naive_paper_cpu", impl="factored", D=793_471, ms=8.0),
            dict(group="vs_naive_paper_cpu", impl="naive", D=793_471, ms=2000.0),
            dict(group="flat_in_D", impl="factored", D=20_000, ms=10.0),
            dict(group="flat_in_D", impl="factored", D=200_000, ms=10.5),
            dict(group="flat_in_D", impl="factored", D=2_000_000, ms=11.0)]
    rows = [dict(r, d=256, m=256) for r in rows]
    got = {r["what"].split(" (")[0]: (r["ratio"], r["target"]) for r in hc.ratios(rows, cfgs)}
    assert got["factored vs linear_cross_entropy"] == (pytest.approx(500.0), 250)
    assert got["factored vs naive"] == (pytest.approx(250.0), 300)
    assert got["factored step at D=2,000,000 / at D=20,000"] == (pytest.approx(1.1), 1.15)
