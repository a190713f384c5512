"""scripts/bench_kernels.py runs end to end (in the Triton interpreter at tiny sizes on CPU)."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU run the real benchmark instead")
def test_bench_kernels_smoke_writes_csv_and_plot(tmp_path):
    pytest.importorskip("triton")
    assert load_script().main(["--smoke", "--out", str(tmp_path)]) == 0
    (csv_path,) = tmp_path.glob("kernels_smoke_*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    ops = {r["op"] for r in rows}
    assert ops == {"gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update"}
    assert all(float(r["median_ms"]) > 0 for r in rows)
    assert {r["impl"] for r in rows if r["op"] == "q_update"} == {"reference", "triton", "torch_2gemm"}
    assert csv_path.with_suffix(".png").stat().st_size > 0


def test_bench_kernels_without_gpu_exits_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert load_script().main([]) == 0
    assert "need a CUDA GPU" in capsys.readouterr().out
