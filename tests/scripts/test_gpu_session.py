"""scripts/gpu_session.py, the GPU benchmark suite: each part's smoke run writes its files
directly into --out and the log ends with the summary; the full suite's limits are those
docs/gpu.md gives. The parts' smoke runs (child processes, compiles) run with -m slow:
``uv run pytest -m slow tests/scripts/test_gpu_session.py`` before a GPU session; the default
suite checks the suite's plumbing."""
from __future__ import annotations

import csv
import re

import gpu_session as gs
import pytest
import torch


def summary(out):
    log = (out / gs.LOG).read_text()
    assert "=== summary" in log
    return log.split("=== summary", 1)[1]


def test_the_tests_parts_paths_exist(tmp_path):
    """The ``tests`` part's pytest steps, smoke and full, name test files that exist."""
    for s in gs.tests(tmp_path, smoke=True) + gs.tests(tmp_path, smoke=False):
        paths = [a for a in s.argv if a.startswith("tests/")]
        assert paths and all((gs.ROOT / a).exists() for a in paths), paths


@pytest.mark.slow  # child processes and compiles: -m slow, before a GPU session (above)
def test_the_correctness_parts_and_bench_heads_smoke(tmp_path):
    """The kernels' pytest step (its junit counted into the summary), compiled_step.py,
    profile_step.py, bench_heads.py and tf32_drift.py at tiny sizes. The ``tests`` part, whose
    gpu-marked tests all skip on a CPU, runs in test_the_gpu_tests_part_smoke; the same pytest
    step's plumbing runs here as ``kernels``."""
    assert gs.main(["kernels", "compiled", "profile", "heads", "tf32", "--out", str(tmp_path), "--smoke"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith("bench_heads_")] == [
        "compiled_step.csv", gs.LOG, "kernel_tests_junit.xml", "launch_cost.csv", "tf32_drift.csv"]
    units = {r["unit"]: r for r in csv.DictReader((tmp_path / "launch_cost.csv").open())}
    assert set(units) == {"torch_op", "triton_empty", "cuda_graph_node"} and float(units["torch_op"]["us"]) > 0
    (row,) = list(csv.DictReader((tmp_path / "compiled_step.csv").open()))
    assert (row["graphs"], row["breaks"]) == ("1", "0")  # the step compiled whole
    assert sorted(p.suffix for p in tmp_path.glob("bench_heads_*")) == [".csv", ".md", ".png"]
    kernels = gs.junit_counts(tmp_path / "kernel_tests_junit.xml")
    assert int(kernels.split()[0]) > 0 and " 0 failed, 0 errors" in kernels, kernels
    text = summary(tmp_path)
    assert "kernel_tests  ok" in text and kernels in text
    assert "profile_step  ok" in text
    assert "compiled_step  ok" in text and "tf32_drift  ok" in text and "launch_cost  ok" in text
    log = (tmp_path / gs.LOG).read_text()  # the profile of the default head, pinned factors side by side
    assert "== factored, loss=sampled, inverse=products" in log and "== factored_sync, loss=sampled, inverse=products, factors=2" in log
    (path,) = tmp_path.glob("bench_heads_smoke_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert any(r["head"] == "factored" and r["status"] == "ok" for r in rows)
    assert "UNMEASURED" in text  # the targets, from the benchmark's output


@pytest.mark.slow  # a pytest child whose tests all skip on a CPU: its paths are test_the_tests_parts_paths_exist's,
# the pytest step's plumbing test_the_correctness_parts_and_bench_heads_smoke's
def test_the_gpu_tests_part_smoke(tmp_path):
    assert gs.main(["tests", "--out", str(tmp_path), "--smoke"]) == 0
    counts = gs.junit_counts(tmp_path / "gpu_tests_junit.xml")
    assert " 0 failed, 0 errors" in counts and "gpu_tests  ok" in summary(tmp_path), counts


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


@pytest.mark.slow  # child processes and compiles: -m slow, before a GPU session (above)
def test_the_d_sweep_part_smoke(tmp_path):
    """dsweep: bench_heads.py --sweep-d (the default factored step and the fused softmaxes at two
    widths) and crossover.py on its CSV, every file directly in --out."""
    assert gs.main(["dsweep", "--out", str(tmp_path), "--smoke"]) == 0
    text = summary(tmp_path)
    assert "heads_dsweep  ok" in text and "crossover  ok" in text, text
    (sweep,) = tmp_path.glob("bench_heads_smoke_dsweep_*.csv")
    rows = list(csv.DictReader(sweep.open()))
    assert {int(r["d"]) for r in rows} == {8, 16}
    fused = hasattr(torch.nn.functional, "linear_cross_entropy")  # torch 2.13 on: torch's fused softmax
    assert {(r["head"], r["variant"]) for r in rows if r["status"] == "ok"} == {("factored", "sampled"),
                                                                              *[("softmax", "torch")][:fused]}
    (cross,) = tmp_path.glob("crossover_*.csv")
    assert [int(r["d"]) for r in csv.DictReader(cross.open())] == [8, 16]
    assert all(p.is_file() for p in tmp_path.iterdir())


@pytest.mark.slow  # four lst-train runs in fresh processes: about two minutes here
def test_the_equal_time_part_smoke(tmp_path):
    """equal_time: the default and the sampled softmax on the n-gram body and on the d = 1024
    transformer (its smoke run at tiny widths), a table and curves for each body."""
    assert gs.main(["equal_time", "--out", str(tmp_path), "--smoke"]) == 0
    for stem in gs.EQUAL_TIME_BODIES:
        (path,) = tmp_path.glob(f"{stem}_*.csv")
        rows = {r["head"]: r for r in csv.DictReader(path.open())}
        assert set(rows) == set(gs.EQUAL_TIME_HEADS), rows
        assert all(int(r["train_steps"]) > 0 and not r.get("error") for r in rows.values()), rows
        assert path.with_suffix(".png").is_file() and (tmp_path / f"{path.stem}_curves.json").is_file()


def test_the_equal_time_pair_runs_both_sides_compiled_on_the_same_setting():
    """On the GPU: the same budget, validation and preset for both heads, trainer=gpu (compile=auto
    compiles there), the transformer of real size on its second body."""
    steps = gs.equal_time(gs.ROOT / "OUT", smoke=False)
    assert [s.name for s in steps] == [n for b in gs.EQUAL_TIME_BODIES for n in (f"{b}_warm_up", b)]
    for warm, s in zip(steps[::2], steps[1::2]):
        assert s.argv[s.argv.index("--heads") + 1:][:2] == gs.EQUAL_TIME_HEADS
        assert "trainer=gpu" in s.argv and s.argv[s.argv.index("--budget-s") + 1] == "60"
        assert "compile=false" not in " ".join(s.argv)
        # the warm-up: the same heads and overrides, a short budget, its files in the scratch folder
        setting = [a for a in s.argv if a.startswith(("model=", "trainer=", "compile"))]
        assert [a for a in warm.argv if a.startswith(("model=", "trainer=", "compile"))] == setting
        assert warm.argv[warm.argv.index("--budget-s") + 1] == str(gs.WARM_UP_S)
        assert f"/{gs.SCRATCH}/" in warm.argv[warm.argv.index("--out") + 1]
        assert s.argv[s.argv.index("--out") + 1] == str(gs.ROOT / "OUT")
    assert "model=gpt_d1024" in steps[3].argv and "model=gpt_d1024" not in steps[1].argv


@pytest.mark.slow  # one lst-train run in a fresh process
def test_the_equal_time_preconditioned_part_smoke(tmp_path):
    """equal_time_preconditioned: head=sampled_preconditioned alone, its table and curves."""
    assert gs.main(["equal_time_preconditioned", "--out", str(tmp_path), "--smoke"]) == 0
    (path,) = tmp_path.glob("equal_time_ngram_preconditioned_*.csv")
    (row,) = list(csv.DictReader(path.open()))
    assert row["head"] == gs.EQUAL_TIME_P_HEAD and int(row["train_steps"]) > 0 and not row.get("error"), row


def test_the_third_head_runs_on_the_pairs_ngram_setting():
    """equal_time_preconditioned takes the n-gram pair's budget, validation, preset and overrides
    (trainer=gpu: compiled as lst-train compiles it), warmed in the scratch folder first."""
    pair = gs.equal_time(gs.ROOT / "OUT", smoke=False)[:2]
    third = gs.equal_time_preconditioned(gs.ROOT / "OUT", smoke=False)
    assert [s.name for s in third] == ["equal_time_ngram_preconditioned_warm_up", "equal_time_ngram_preconditioned"]

    def setting(s):
        heads = s.argv.index("--heads")
        rest = s.argv[heads + 1:]
        return s.argv[:heads], [a for a in rest if not a.startswith("-") and a not in gs.EQUAL_TIME_HEADS
                                and a != gs.EQUAL_TIME_P_HEAD and "OUT" not in a and "equal_time" not in a]

    for mine, theirs in zip(third, pair):
        assert mine.argv[mine.argv.index("--heads") + 1] == gs.EQUAL_TIME_P_HEAD
        assert setting(mine) == setting(theirs), (mine.argv, theirs.argv)
    assert f"/{gs.SCRATCH}/" in third[0].argv[third[0].argv.index("--out") + 1]


def test_the_full_suite_takes_what_docs_gpu_md_says_and_writes_into_out(capsys):
    """The step limits add up to the bound docs/gpu.md states, and every file goes directly into --out
    (what a step writes only for the log into --out's scratch folder, removed after the run)."""
    assert gs.main(["--list"]) == 0
    total = int(re.search(r"at most (\d+) s in all", capsys.readouterr().out).group(1))
    stated = re.search(r"at most (\d+) s \(the sum of the steps' limits\)", (gs.ROOT / "docs" / "gpu.md").read_text(), re.I)
    assert stated and total == int(stated.group(1)), (total, stated)
    for s in gs.plan(list(gs.PARTS), gs.ROOT / "OUT", False):
        outs = [a for a in s.argv if "OUT" in a]
        rests = [a.split("OUT")[1] for a in outs]
        assert all(r in ("", "/") or r.count("/") == 1 or r.startswith(f"/{gs.SCRATCH}/") for r in rests), outs


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


def test_a_run_failed_inside_a_step_is_in_the_summary(tmp_path, monkeypatch):
    """quality_table.py goes on past a failed run, prints why and exits 1: the summary names the run."""
    why = "synthetic/factored-sampled/budget failed: RuntimeError: accessing tensor output of CUDAGraphs"
    step = gs.Step("equal_time_ngram", [gs.PY, "-c", f"print('!! {why}'); raise SystemExit(1)"], 60)
    monkeypatch.setitem(gs.PARTS, "equal_time", lambda out, smoke: [step])
    assert gs.main(["equal_time", "--out", str(tmp_path)]) == 1
    text = summary(tmp_path)
    assert "equal_time_ngram  exit 1" in text and f"run  failed  {why}" in text


def test_a_silent_step_past_its_limit_is_killed(tmp_path, monkeypatch):
    slow = gs.Step("quiet", [gs.PY, "-c", "import time; time.sleep(30)"], 1.0)
    monkeypatch.setitem(gs.PARTS, "tests", lambda out, smoke: [slow])
    assert gs.main(["tests", "--out", str(tmp_path)]) == 1
    assert "quiet  exit 124" in (tmp_path / gs.LOG).read_text()


@pytest.mark.slow  # child processes and compiles: -m slow, before a GPU session (above)
def test_the_batch_sizes_part_smoke(tmp_path):
    """compiled_step.py --batch-sizes at tiny sizes on the CPU, the Z-loss's step (the default head's
    compiled step through random batch sizes, equal to the eager one: test_batch_shapes.py's
    fused and accumulated cases): m padded against exactly m, and 30 random sizes up to 24
    compiled as two graphs (batch sizes 16 and 32)."""
    assert gs.main(["batch_sizes", "--out", str(tmp_path), "--smoke"]) == 0
    (row,) = list(csv.DictReader((tmp_path / "compiled_batch_sizes.csv").open()))
    assert row["loss"] == "zloss"
    assert (row["m"], row["padded_to"], row["sizes"], row["graphs"]) == ("24", "32", "30", "2")
    assert float(row["padded_over_static"]) > 0 and row["captures"] == ""  # no CUDA graph on a CPU
    assert "compiled_batch_sizes  ok" in summary(tmp_path)



def test_a_smoke_run_keeps_the_sizes_it_is_given():
    """``--smoke`` makes tiny defaults, not tiny sizes whatever was asked: compiled_step.py keeps
    a size given on the command line."""
    import compiled_step
    args = compiled_step.parse_args(["--smoke", "--batch-sizes", "--m", "20"])
    assert (args.D, args.d, args.m, args.steps) == (compiled_step.SMOKE["D"], compiled_step.SMOKE["d"], 20, 1)
    assert compiled_step.parse_args(["--smoke", "--batch-sizes"]).m == 3 * compiled_step.SMOKE["m"] // 4
    assert compiled_step.parse_args([]).m == compiled_step.TARGET["m"]
