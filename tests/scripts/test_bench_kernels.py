"""scripts/bench_kernels.py runs end to end (in the Triton interpreter at tiny sizes on CPU),
and writes where the output policy says."""
from __future__ import annotations

import csv

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU run the real benchmark instead")


@pytest.fixture(scope="module")
def bk():
    pytest.importorskip("triton")
    import bench_kernels  # noqa: PLC0415  (after the skip: it imports the kernels)

    return bench_kernels


def test_default_smoke_run_writes_csv_and_plot_in_its_run_directory(bk, sandbox):
    run_dir = sandbox.run_default(bk.main, ["--smoke"], "bench_kernels")
    (csv_path,) = run_dir.glob("kernels_smoke_*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    ops = {r["op"] for r in rows}
    assert ops == {"gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update"}
    assert all(float(r["median_ms"]) > 0 and r["machine"] == bk.machine_name() for r in rows)
    assert {r["impl"] for r in rows if r["op"] == "q_update"} == {"reference", "triton", "torch_2gemm"}
    assert csv_path.with_suffix(".png").stat().st_size > 0


def test_update_results_writes_the_results_folder(bk, sandbox):
    machine = bk.machine_name()
    assert sandbox.run_update(bk.main, ["--smoke"]) == {f"kernels_smoke_{machine}.csv",
                                                         f"kernels_smoke_{machine}.png"}


def test_without_gpu_exits_cleanly_and_writes_nothing(bk, sandbox, capsys):
    assert bk.main([]) == 0
    assert "need a CUDA GPU" in capsys.readouterr().out
    assert not (sandbox.cwd / "outputs").exists()
