"""scripts/gpu_session.py, the GPU benchmark suite: each part's smoke run writes its files
directly into --out and the log ends with the summary; the full suite's limits are those
docs/gpu.md gives."""
from __future__ import annotations

import csv
import re

import gpu_session as gs
import pytest


def summary(out):
    log = (out / gs.LOG).read_text()
    assert "=== summary" in log
    return log.split("=== summary", 1)[1]


def test_the_correctness_parts_and_bench_heads_smoke(tmp_path):
    assert gs.main(["tests", "kernels", "compiled", "profile", "heads", "tf32", "--out", str(tmp_path), "--smoke"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith("bench_heads_")] == [
        "compiled_step.csv", gs.LOG, "gpu_tests_junit.xml", "kernel_tests_junit.xml", "tf32_drift.csv"]
    (row,) = list(csv.DictReader((tmp_path / "compiled_step.csv").open()))
    assert (row["graphs"], row["breaks"]) == ("1", "0")  # the step compiled whole
    assert sorted(p.suffix for p in tmp_path.glob("bench_heads_*")) == [".csv", ".md", ".png"]
    kernels = gs.junit_counts(tmp_path / "kernel_tests_junit.xml")
    assert int(kernels.split()[0]) > 0 and " 0 failed, 0 errors" in kernels, kernels
    text = summary(tmp_path)
    assert "kernel_tests  ok" in text and kernels in text
    assert "gpu_tests" in text and "profile_step  ok" in text
    assert "compiled_step  ok" in text and "tf32_drift  ok" in text
    log = (tmp_path / gs.LOG).read_text()  # the profile of the default head, pinned factors side by side
    assert "== factored, loss=sampled, inverse=products" in log and "== factored_sync, loss=sampled, inverse=products, factors=2" in log
    (path,) = tmp_path.glob("bench_heads_smoke_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert any(r["head"] == "factored" and r["status"] == "ok" for r in rows)
    assert "UNMEASURED" in text  # the targets, from the benchmark's output


@pytest.mark.slow  # two children importing Lightning, and one lst-train run: about a minute here
def test_the_whole_step_and_quality_parts_smoke(tmp_path):
    assert gs.main(["whole_step", "quality", "--out", str(tmp_path), "--smoke"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert gs.LOG in names and all(p.is_file() for p in tmp_path.iterdir()), names
    (whole,) = tmp_path.glob("whole_step_smoke_*.csv")
    assert {r["head"] for r in csv.DictReader(whole.open())} == {"factored", "softmax"}
    (quality,) = tmp_path.glob("quality_large_D_*.csv")
    (row,) = list(csv.DictReader(quality.open()))
    assert row["head"] == "factored-zloss" and int(row["train_steps"]) > 0 and not row.get("error"), row


def test_the_full_suite_takes_what_docs_gpu_md_says_and_writes_into_out(capsys):
    """The step limits add up to the bound docs/gpu.md states, and every file goes directly into --out."""
    assert gs.main(["--list"]) == 0
    total = int(re.search(r"at most (\d+) s in all", capsys.readouterr().out).group(1))
    stated = re.search(r"at most (\d+) s \(the sum of the steps' limits\)", (gs.ROOT / "docs" / "gpu.md").read_text(), re.I)
    assert stated and total == int(stated.group(1)), (total, stated)
    for s in gs.plan(list(gs.PARTS), gs.ROOT / "OUT", False):
        outs = [a for a in s.argv if "OUT" in a]
        assert all(a.endswith("OUT") or a.split("OUT")[1].count("/") == 1 for a in outs), (s.name, outs)


def test_an_unknown_part_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit):
        gs.main(["kernel", "--out", "x"])
    assert "the parts are tests, kernels" in capsys.readouterr().err


def test_a_failed_smoke_run_sends_bench_heads_to_the_torch_ops(tmp_path, monkeypatch):
    def plan(out, smoke):
        fail = gs.Step("bench_heads_smoke", [gs.PY, "-c", "raise SystemExit(3)"], 60)
        echo = gs.Step("bench_heads", [gs.PY, "-c", "import os; print('kernels:', os.environ.get('LST_KERNELS'))"],
                       60, if_previous_failed={"LST_KERNELS": "torch"})
        return [fail, echo]

    monkeypatch.setitem(gs.PARTS, "heads", plan)
    assert gs.main(["heads", "--out", str(tmp_path)]) == 1
    log = (tmp_path / gs.LOG).read_text()
    assert "kernels: torch" in log and "bench_heads_smoke  exit 3" in log and "bench_heads (LST_KERNELS=torch)  ok" in log


def test_a_silent_step_past_its_limit_is_killed(tmp_path, monkeypatch):
    slow = gs.Step("quiet", [gs.PY, "-c", "import time; time.sleep(30)"], 1.0)
    monkeypatch.setitem(gs.PARTS, "tests", lambda out, smoke: [slow])
    assert gs.main(["tests", "--out", str(tmp_path)]) == 1
    assert "quiet  exit 124" in (tmp_path / gs.LOG).read_text()
