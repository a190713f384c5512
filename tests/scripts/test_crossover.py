"""scripts/crossover.py: the counted crossover is the factored step's FLOPs over a full softmax's
6 m d per class (checked against count_step.py's own count), and a GPU sweep's CSV gives the
measured one where the fused softmax's line meets the factored step."""
from __future__ import annotations

import csv

import crossover as co
import pytest
from count_step import count


def test_the_counted_crossover_is_the_factored_flops_over_6_m_d(tmp_path):
    assert co.main(["--smoke", "--d", "8", "--m", "16", "--S", "64", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("crossover_*.csv")
    (row,) = list(csv.DictReader(path.open()))
    flops = sum(count(300, 8, 16, loss="sampled").flops.values())
    assert int(row["crossover_D"]) == round(flops / (6 * 16 * 8))
    assert float(row["units"]) == pytest.approx(flops / (2 * 16 * 9 ** 2), abs=0.01)  # w = d + 1: the bias
    assert float(row["vs_sampled"]) == pytest.approx(int(row["crossover_D"]) / 64, abs=0.01)
    assert row["measured_D"] == "" and path.with_suffix(".md").read_text().startswith("# Where")
    # --counted: the same rows from the CSV, not counted again; --measured a folder without a sweep: one line
    again = tmp_path / "again"
    assert co.main(["--counted", str(path), "--out", str(again)]) == 0
    (row2,) = list(csv.DictReader(next(again.glob("crossover_*.csv")).open()))
    assert row2 == row
    with pytest.raises(FileNotFoundError, match="bench_heads_dsweep"):
        co.main(["--counted", str(path), "--measured", str(tmp_path), "--out", str(again)])


def test_a_gpu_sweep_gives_the_measured_crossover(tmp_path):
    """The softmax line through its two sizes (the faster fused form at each) meets the factored step."""
    path = tmp_path / "bench_heads_dsweep_GPU.csv"
    cols = ["machine", "device", "head", "variant", "D", "d", "m", "median_ms", "status"]
    rows = [("factored_graph", "sampled", 100_000, 1.0), ("factored_graph", "sampled", 1_000_000, 1.2),
            ("softmax", "torch", 100_000, 0.6), ("softmax", "cce", 100_000, 0.5),
            ("softmax", "torch", 1_000_000, 5.0), ("softmax", "cce", 1_000_000, 6.0)]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        w.writerows([("GPU", "cuda", h, v, D, 512, 1024, t, "ok") for h, v, D, t in rows])
        w.writerow(("GPU", "cuda", "softmax", "cce", 2_000_000, 512, 1024, "", "skipped: CUDA only"))
    (D_star, on), = co.measured_crossovers(path).values()
    # the factored step 1.1 ms (median); the softmax 0.5 ms at 10^5 and 5.0 at 10^6
    assert on == "GPU" and D_star == round(100_000 + (1.1 - 0.5) / (4.5 / 900_000))
