"""scripts/bench_step_cpu.py: the two steps side by side at a small size, each timed and counted."""
from __future__ import annotations

import csv

import pytest

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


def test_the_compiled_rivals_row_sgd_is_sgd_on_its_sparse_gradient():
    """``_row_sgd_`` (the compiled rival's update): repeated ids summed, -1 ignored, as torch's SGD
    steps the same rows' sparse COO gradient."""
    import torch

    g = torch.Generator().manual_seed(0)
    table = torch.randn(10, 3, generator=g, dtype=torch.float64)
    ids = torch.tensor([4, 1, 4, -1, 7])
    rows = torch.randn(5, 3, generator=g, dtype=torch.float64)
    want = torch.nn.Parameter(table.clone())
    keep = ids >= 0
    want.grad = torch.sparse_coo_tensor(ids[keep].unsqueeze(0), rows[keep], (10, 3))
    torch.optim.SGD([want], lr=bs.LR).step()
    got = table.clone()
    bs._row_sgd_(got, ids, rows, bs.LR)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-15)


@pytest.mark.slow  # the default's step compiles cold: about 25 s of CPU
def test_compile_times_each_step_eager_and_compiled(capsys, tmp_path):
    assert bs.main(["--D", "300", "--d", "8", "--m", "8", "--steps", "10", "--compile", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "default compiled / eager: " in out and "sampled_softmax compiled / eager: " in out
    rows = list(csv.DictReader((tmp_path / "step_cpu.csv").open()))
    assert [r["head"] for r in rows] == ["default", "sampled_softmax", "default+compiled", "sampled_softmax+compiled",
                                         "sampled_softmax_adam", "sampled_softmax_adam+compiled"]
    assert all(float(r["compile_s"]) > 0 for r in rows if r["compiled"] == "True")
    assert min(float(r["over_rival_best"]) for r in rows if r["head"].startswith("sampled_softmax")) == 1.0
