"""scripts/gpu_session.py: each call's smoke run writes what the device tool brings back
(at most 8 files, all directly in --out) and its log ends with the summary."""
from __future__ import annotations

import csv

import gpu_session as gs
import pytest


def summary(out, call):
    log = (out / f"{call}_log.txt").read_text()
    assert f"=== {call} summary" in log
    return log.split(f"=== {call} summary", 1)[1]


def test_call1_smoke_runs_the_gpu_and_kernel_tests_and_bench_heads(tmp_path):
    assert gs.main(["call1", "--out", str(tmp_path), "--smoke"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith("bench_heads_")] == [
        "call1_gpu_junit.xml", "call1_kernels_junit.xml", "call1_log.txt"]
    assert sorted(p.suffix for p in tmp_path.glob("bench_heads_*")) == [".csv", ".md", ".png"]
    kernels = gs.junit_counts(tmp_path / "call1_kernels_junit.xml")
    assert int(kernels.split()[0]) > 0 and " 0 failed, 0 errors" in kernels, kernels
    text = summary(tmp_path, "call1")
    assert "kernel_tests  ok" in text and kernels in text
    assert "gpu_tests" in text and "profile_step  ok" in text
    log = (tmp_path / "call1_log.txt").read_text()  # the profile of the default head, pinned factors side by side
    assert "== factored, loss=sampled, inverse=products" in log and "== factored_sync, loss=sampled, inverse=products, factors=2" in log
    (path,) = tmp_path.glob("bench_heads_smoke_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert any(r["head"] == "factored" and r["status"] == "ok" for r in rows)
    assert "UNMEASURED" in text  # the targets, from the benchmark's output


@pytest.mark.slow  # two children importing Lightning, and one lst-train run: about a minute here
def test_call2_smoke_writes_the_whole_step_and_quality_files(tmp_path):
    assert gs.main(["call2", "--out", str(tmp_path), "--smoke"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 8 and "call2_log.txt" in names, names
    (whole,) = tmp_path.glob("whole_step_smoke_*.csv")
    assert {r["head"] for r in csv.DictReader(whole.open())} == {"factored", "softmax"}
    (quality,) = tmp_path.glob("quality_large_D_*.csv")
    (row,) = list(csv.DictReader(quality.open()))
    assert row["head"] == "factored-zloss" and int(row["train_steps"]) > 0 and not row.get("error"), row


def test_the_full_calls_fit_the_device_tool():
    """Both calls' steps together end inside the lease's 15 minutes of device time with the
    machine's start (about 30 s seen) and a rerun's margin, and every file goes directly into --out."""
    total = 0
    for name, plan in gs.CALLS.items():
        steps = plan(gs.ROOT / "OUT", False)
        total += sum(s.timeout_s for s in steps)
        for s in steps:
            outs = [a for a in s.argv if "OUT" in a]
            assert all(a.endswith("OUT") or a.split("OUT")[1].count("/") == 1 for a in outs), (name, outs)
    assert total <= 740, total


def test_a_failed_smoke_run_sends_bench_heads_to_the_torch_ops(tmp_path, monkeypatch):
    def plan(out, smoke):
        fail = gs.Step("bench_heads_smoke", [gs.PY, "-c", "raise SystemExit(3)"], 60)
        echo = gs.Step("bench_heads", [gs.PY, "-c", "import os; print('kernels:', os.environ.get('LST_KERNELS'))"],
                       60, if_previous_failed={"LST_KERNELS": "torch"})
        return [fail, echo]

    monkeypatch.setitem(gs.CALLS, "call2", plan)
    assert gs.main(["call2", "--out", str(tmp_path)]) == 1
    log = (tmp_path / "call2_log.txt").read_text()
    assert "kernels: torch" in log and "bench_heads_smoke  exit 3" in log and "bench_heads (LST_KERNELS=torch)  ok" in log


def test_a_silent_step_past_its_limit_is_killed(tmp_path, monkeypatch):
    slow = gs.Step("quiet", [gs.PY, "-c", "import time; time.sleep(30)"], 1.0)
    monkeypatch.setitem(gs.CALLS, "call1", lambda out, smoke: [slow])
    assert gs.main(["call1", "--out", str(tmp_path)]) == 1
    assert "quiet  exit 124" in (tmp_path / "call1_log.txt").read_text()
