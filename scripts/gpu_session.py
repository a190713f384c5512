"""The GPU benchmark suite: the CUDA checks and the benchmarks of the GPU targets, on any
machine with a CUDA GPU (docs/gpu.md: what it runs, what it needs, how long it takes).

    python3 scripts/gpu_session.py --out DIR                 # every part, in order
    python3 scripts/gpu_session.py tests kernels --out DIR   # some of them
    python3 scripts/gpu_session.py --list                    # the parts and their time limits

The parts: ``tests`` (the gpu-marked tests), ``kernels`` (the kernel tests, native), ``compiled``
(compiled_step.py: the compiled step against its targets), ``batch_sizes`` (compiled_step.py
--batch-sizes: 30 random batch sizes through the CUDA graphs, m = 1000 padded), ``profile``
(profile_step.py), ``heads`` (bench_heads.py at the targets' sizes), ``whole_step``
(bench_whole_step.py on the GPU), ``quality`` (every head at D = 10^6 for the same training time),
``equal_time`` (the default against the sampled softmax, both compiled, 60 s each at D = 10^6, on
the n-gram body and the d = 1024 transformer), ``equal_time_preconditioned`` (head=sampled_preconditioned
on equal_time's n-gram setting, beside its pair), ``dsweep`` (bench_heads.py --sweep-d: d = 512 to
4096 against the fused softmaxes, and crossover.py's measured crossover beside the counted one),
``tf32`` (tf32_drift.py: TF32 products against float64).
Each step runs in its own process (a CUDA error in one does not poison the next), under its own
time limit; the suite tees their output into ``gpu_session_log.txt`` in ``--out`` and ends that log
with a table: each step's exit status and time, the tests' counts from their junit XML, every
PASS / FAIL / UNMEASURED target line the benchmarks printed, and every run a step reports failed. Every file lies directly in ``--out``.

``--smoke`` runs the same steps at tiny sizes on whatever device is there (CPU in the test
suite, tests/scripts/test_gpu_session.py), with no time limit: the limits are the GPU's plan, and
a smoke run on a loaded CPU checks what the steps do, not how fast. Its steps run on one CPU thread
(``OMP_NUM_THREADS=1``): at tiny sizes OpenMP's spin-waits cost more than the work.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# The test paths that collect without the app's frameworks (hydra, wandb, datasets may be absent
# from a GPU machine's Python): every gpu-marked test of the suite lies in them.
GPU_TEST_PATHS = ["tests/spherical", "tests/baselines", "tests/heads", "tests/lst_kernels",
                  "tests/scripts/test_bench_whole_step.py"]
# The cubin compile of every launch is checked on the CPU by the suite; on the GPU the kernels run.
NOT_ON_THE_GPU = "tests/lst_kernels/test_compile_for_gpu.py"
# The heads at D = 10^6 in the quality comparison (quality_table.py names), the contested ones
# first (the default head, its step replayed from a CUDA graph by head.step=auto, with its Neumann
# factors fixed and adaptive (Stabiliser.neumann), and the sampled softmax), so that a step cut
# short by its limit loses the least telling rows.
QUALITY_HEADS = ["factored-sampled", "factored-sampled-adaptive", "sampled-log_uniform", "adaptive", "softmax",
                 "factored-zloss", "hsoftmax"]
TARGET = re.compile(r"^(PASS|FAIL|UNMEASURED)\s+(.*)$")
#: a run that failed inside a step that goes on with the others (quality_table.py's "!! ... failed: why")
RUN_FAILED = re.compile(r"^!! (.+ failed: .*)$")
#: the most one test may take on the GPU (the default head's step compiles in about a minute on an H200)
PER_TEST_S = 150
#: the environment of the pytest steps: each failure's reason printed when it happens
AT_ONCE = {"LST_REPORT_AT_ONCE": "1"}


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    junit: Path | None = None
    # the environment to run with instead when the step before this one failed
    if_previous_failed: dict[str, str] | None = None


def workers(n: int) -> list[str]:
    """pytest-xdist's ``-n`` where it is installed (the project's venv has it; a bare GPU machine
    may not): the tests' Triton compiles spread over the machine's cores."""
    return ["-n", str(n)] if importlib.util.find_spec("xdist") else []


def pytest_argv(paths: list[str], junit: Path, *extra: str) -> list[str]:
    # -o addopts= drops the suite's default "-m 'not slow' --durations=30"; -p no:cacheprovider
    # writes no .pytest_cache into the checkout; -v names each test as it ends and -rA again at the
    # end; a failure's reason is printed at once (tests/conftest.py, LST_REPORT_AT_ONCE); where
    # pytest-timeout is installed, one test is stopped after PER_TEST_S.
    timeout = ["--timeout", str(PER_TEST_S)] if importlib.util.find_spec("pytest_timeout") else []
    return [PY, "-m", "pytest", *paths, "-v", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
            "--import-mode=importlib", f"--junitxml={junit}", *timeout, *extra]


def tests(out: Path, smoke: bool) -> list[Step]:
    """The gpu-marked tests: the factored head on CUDA against the float64 naive head step for
    step, every loss; its step replayed from a CUDA graph bit-identical to the eager step; the
    Liger and cut-cross-entropy heads against torch."""
    junit = out / "gpu_tests_junit.xml"
    # smoke: one file (collecting every path costs 20 s on a 2-core CPU)
    argv = pytest_argv(["tests/spherical/test_cuda.py"] if smoke else GPU_TEST_PATHS, junit, "-m", "gpu",
                       *([] if smoke else workers(4)))
    return [Step("gpu_tests", argv, 240, env=dict(AT_ONCE), junit=junit)]


def kernels(out: Path, smoke: bool) -> list[Step]:
    """The kernel tests natively: every kernel against its reference in float32, float64 and bf16,
    odd shapes, repeated classes."""
    junit = out / "kernel_tests_junit.xml"
    argv = pytest_argv(["tests/lst_kernels/test_gather_dot_kernel.py"] if smoke else ["tests/lst_kernels"], junit,
                       "-m", "not slow", "--deselect", NOT_ON_THE_GPU, *(["-k", "shape1"] if smoke else workers(8)))
    return [Step("kernel_tests", argv, 60, env=dict(AT_ONCE), junit=junit)]


def compiled(out: Path, smoke: bool) -> list[Step]:
    """The factored head's step compiled whole (compiled_step.py) at the target size, the Z-loss's
    and the default head's: graph breaks, Inductor's kernels a step, eager against compiled against
    compiled inside a CUDA graph, and the autograd and accumulated steps (the HF Trainer's and
    Fabric's routes) against the graph step, with PASS / FAIL lines for the targets; before it,
    launch_cost.py: one empty kernel launch and one CUDA-graph node, the units of a launch-bound step."""
    step = [PY, "scripts/compiled_step.py", "--out", str(out)]
    launches = Step("launch_cost", [PY, "scripts/launch_cost.py", "--out", str(out), *(["--smoke"] if smoke else [])],
                    60 if smoke else 30)
    if smoke:  # aot_eager: Dynamo's graphs without Inductor's code generation (a CPU compiles it slowly)
        return [launches, Step("compiled_step", [*step, "--smoke", "--backend", "aot_eager", "--loss", "zloss"], 120)]
    return [launches, Step("compiled_step", step, 240)]


def batch_sizes(out: Path, smoke: bool) -> list[Step]:
    """compiled_step.py --batch-sizes: the default head's step of 1000 rows padded to its batch size
    against exactly 1000, and 30 random batch sizes through its CUDA graphs (a graph a size)."""
    step = [PY, "scripts/compiled_step.py", "--batch-sizes", "--out", str(out)]
    if smoke:  # the Z-loss's graphs compile faster (the default head's: tests/spherical/test_batch_shapes.py)
        return [Step("compiled_batch_sizes", [*step, "--loss", "zloss", "--smoke", "--backend", "aot_eager"], 120)]
    return [Step("compiled_batch_sizes", [*step, "--loss", "sampled", "--m", "1000"], 300)]


def tf32(out: Path, smoke: bool) -> list[Step]:
    """The drift of TF32 products (``tf32=True``, opt-in) against float64 over 10^4 steps, beside
    full float32 products (tf32_drift.py)."""
    drift = [PY, "scripts/tf32_drift.py", "--out", str(out)]
    return [Step("tf32_drift", [*drift, "--smoke", "--loss", "zloss"] if smoke else [*drift, "--steps", "10000"],
                 60 if smoke else 120)]


def profile(out: Path, smoke: bool) -> list[Step]:
    """The default head's step profiled (lst-train's loss=sampled with its negatives and P): eager,
    sync-free and from a graph, the last two at 2 and at 6 Neumann factors side by side; its
    tables go into the log."""
    argv = [PY, "scripts/profile_step.py", "--loss", "sampled", "--inverse", "products", "--factors", "2,6",
            "--out", str(out / SCRATCH / "profile_step")]
    return [Step("profile_step", [*argv, "--smoke"] if smoke else argv, 60 if smoke else 50)]


def heads(out: Path, smoke: bool) -> list[Step]:
    """bench_heads.py: a smoke run of the factored paths (the Triton compiles), then the targets'
    sizes (D = 10^4, 793 471 and 2 x 10^7 at d = 512, the paper's d = 300); if the smoke run
    fails (the machine's Triton, say), the full run times the factored head on its torch ops."""
    bench = [PY, "scripts/bench_heads.py"]
    if smoke:
        return [Step("bench_heads", [*bench, "--smoke", "--D", "50", "--out", str(out)], 120)]
    scratch = out / SCRATCH / "bench_heads_smoke"
    factored = ["--heads", "factored/zloss,factored_sync,factored_graph"]
    return [Step("bench_heads_smoke", [*bench, "--smoke", *factored, "--out", str(scratch)], 40),
            Step("bench_heads", [*bench, "--D", "10000,793471,20000000", "--d", "512,300", "--m", "128,1024",
                                 "--all-losses-up-to", "10000", "--budget-s", "0.1", "--deadline-s", "120",
                                 "--out", str(out)], 150, if_previous_failed={"LST_KERNELS": "torch"})]


def whole_step(out: Path, smoke: bool) -> list[Step]:
    """The whole training step on the GPU: D = 793 471 (the ratios to the full and hierarchical
    softmax) and 10^6 (the flatness pair, its D = 10^4 model built beside it), 2 048 tokens a
    step (at 256 every head's whole step is bound by kernel launches on an H100 or H200)."""
    argv = [PY, "scripts/bench_whole_step.py", "--out", str(out)]
    if smoke:
        return [Step("whole_step", [*argv, "--smoke", "--D", "50", "--bodies", "ngram_mlp", "--heads", "softmax"],
                     120)]
    return [Step("whole_step", [*argv, "--device", "cuda", "--tokens", "2048", "--D", "793471,1000000",
                                "--all-losses-up-to", "0", "--budget-s", "0.3", "--deadline-s", "75"], 110)]


def quality(out: Path, smoke: bool) -> list[Step]:
    """Every head at D = 10^6 trained for the same 15 s (validation excluded), validated on the
    same 512 held-out examples every 5 s: curves against training time."""
    argv = [PY, "scripts/quality_table.py", "--tasks", "synthetic", "--modes", "budget", "--budget-clock", "train",
            "--stem", "quality_large_D", "--out", str(out)]
    if smoke:
        return [Step("quality_large_D", [*argv, "--preset", "quick", "--budget-s", "1", "--heads", "factored-zloss"],
                     180)]
    return [Step("quality_large_D", [*argv, "--preset", "large_D", "--budget-s", "15", "--val-every-s", "5",
                                     "--heads", *QUALITY_HEADS, "-o", "trainer=gpu"], 260)]


# equal_time's rivals (quality_table.py names): lst-train's default and the sampled softmax, each as
# lst-train runs it on one GPU (compile=auto: the body and the sampled softmax's static rows compiled,
# the default's own compiled step replayed from a CUDA graph)
EQUAL_TIME_HEADS = ["factored-sampled", "sampled-log_uniform"]
# equal_time's bodies: its stem -> the overrides (the transformer's smoke run: its preset at tiny widths)
EQUAL_TIME_BODIES = {"equal_time_ngram": [], "equal_time_gpt_d1024": ["-o", "model=gpt_d1024"]}
#: equal_time's warm-up run of each head before the measured pair (seconds of training): its compiles
WARM_UP_S = 3
TINY_GPT = ["-o", "model.embed_dim=16", "-o", "model.num_layers=1", "-o", "model.num_heads=2",
            "-o", "model.hidden_dim=16"]


def budget_runs(out: Path, smoke: bool, heads: list[str], bodies: dict[str, tuple[list[str], int, int]]) -> list[Step]:
    """quality_table.py's runs of ``heads`` at D = 10^6 for the same 60 s of training (validation
    excluded, every 15 s on the same 512 held-out examples: curves against training time), compiled
    as lst-train compiles them on one GPU, their compile caches warmed by a short run of each first;
    ``bodies``: stem -> (the body's overrides, the warm-up's limit, the runs' limit); files named
    after the GPU."""
    argv = [PY, "scripts/quality_table.py", "--tasks", "synthetic", "--modes", "budget", "--budget-clock", "train",
            "--heads", *heads]
    if smoke:
        return [Step(stem, [*argv, "--out", str(out), "--preset", "quick", "--budget-s", "1", "--stem", stem, *body,
                            *(TINY_GPT if body else [])], 240) for stem, (body, _, _) in bodies.items()]
    # each run: its process's start (~10 s), 60 s of training, four validations; the transformer's
    # start and compiles take longer. Before each body's runs, every head runs WARM_UP_S seconds into
    # the scratch folder: their compiles fill Inductor's caches on disk, so that the measured runs
    # compile from them, as a long run's compiles are a small part of it (on an H200 the default's
    # step alone compiles in 54 s cold, most of a 60 s budget)
    full = [*argv, "--preset", "large_D", "-o", "trainer=gpu"]
    steps = []
    for stem, (body, warm, limit) in bodies.items():
        steps.append(Step(f"{stem}_warm_up", [*full, "--budget-s", str(WARM_UP_S), "--stem", f"{stem}_warm_up", *body,
                                             "--out", str(out / SCRATCH / "warm_up")], warm))
        steps.append(Step(stem, [*full, "--budget-s", "60", "--val-every-s", "15", "--stem", stem, *body,
                                 "--out", str(out)], limit))
    return steps


def equal_time(out: Path, smoke: bool) -> list[Step]:
    """The default against the sampled softmax (``budget_runs``) on the n-gram body and on the
    d = 1024 transformer (model=gpt_d1024)."""
    limits = ((150, 170), (180, 190))
    return budget_runs(out, smoke, EQUAL_TIME_HEADS,
                       {stem: (body, *lim) for (stem, body), lim in zip(EQUAL_TIME_BODIES.items(), limits)})


#: equal_time_preconditioned's head (quality_table.py's name): the sampled softmax with the default's P on
#: its drawn rows (head=sampled_preconditioned), on equal_time's n-gram body and setting, its rows read beside
#: that part's
EQUAL_TIME_P_HEAD = "sampled-preconditioned"


def equal_time_preconditioned(out: Path, smoke: bool) -> list[Step]:
    """``head=sampled_preconditioned`` alone on ``equal_time``'s n-gram setting (``budget_runs``):
    the third head beside that part's pair, in a file of its own."""
    return budget_runs(out, smoke, [EQUAL_TIME_P_HEAD],
                       {"equal_time_ngram_preconditioned": (EQUAL_TIME_BODIES["equal_time_ngram"], 90, 110)})


def dsweep(out: Path, smoke: bool) -> list[Step]:
    """bench_heads.py --sweep-d: lst-train's default factored step (from its CUDA graph) against
    F.linear_cross_entropy, Liger-Kernel and cut-cross-entropy in bf16 at d = 512 to 4096, m = 1024,
    D = 10^5 and 10^6; then crossover.py: the D where the faster fused softmax meets the default,
    measured, beside the committed count's."""
    bench = [PY, "scripts/bench_heads.py", "--sweep-d", "--out", str(out)]
    cross = [PY, "scripts/crossover.py", "--measured", str(out), "--out", str(out)]
    if smoke:
        return [Step("heads_dsweep", [*bench, "--smoke"], 60), Step("crossover", [*cross, "--smoke"], 60)]
    # each width and D compiles the default's step again (on an H200: 3 of them in 50 s)
    return [Step("heads_dsweep", [*bench, "--budget-s", "0.1", "--deadline-s", "150"], 170),
            Step("crossover", [*cross, "--counted", "benchmarks/results/crossover.csv"], 20)]


#: the parts in the order the suite runs them: correct first, then fast, then quality
PARTS = {"tests": tests, "kernels": kernels, "compiled": compiled, "batch_sizes": batch_sizes, "profile": profile,
         "heads": heads,
         "dsweep": dsweep, "equal_time": equal_time, "equal_time_preconditioned": equal_time_preconditioned,
         "whole_step": whole_step, "quality": quality, "tf32": tf32}
LOG = "gpu_session_log.txt"
# the outputs a step writes only for its log (profiles, a smoke run before the real one): removed after the run
SCRATCH = "scratch"


def summary_row(line: str) -> tuple[str, str, str, str] | None:
    """The summary's row of a step's output line: a target's verdict, a failed run, or None."""
    if m := TARGET.match(line):
        return ("  target", m.group(1), "", m.group(2))
    if m := RUN_FAILED.match(line):
        return ("  run", "failed", "", m.group(1)[:300])
    return None


def junit_counts(path: Path | None) -> str:
    """'N passed, N failed, N errors, N skipped' from a junit XML file, or why there is none."""
    if path is None:
        return ""
    if not path.exists():
        return "no junit XML"
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"


def run_step(step: Step, log, limited: bool = True) -> tuple[int, float, list[str]]:
    """Run one step, its output to the console and the log; (exit status, seconds, target lines).
    ``limited``: killed past its time limit (exit status 124)."""
    # a bare checkout (the GPU machine): the children find the package in src/ and triton_kernels/
    path = [str(ROOT / "src"), str(ROOT / "triton_kernels"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path), **step.env}
    head = f"\n=== {step.name}: {' '.join(step.argv)}"
    print(head, flush=True)
    log.write(head + "\n")
    t0 = time.perf_counter()
    targets: list[str] = []
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed: list[bool] = []  # a step silent past its limit is killed too: the timer does not wait for a line
    timer = threading.Timer(step.timeout_s, lambda: (killed.append(True), proc.kill()))
    if limited:
        timer.start()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            log.flush()  # a run cut off keeps what reached the file
            if summary_row(line.strip()) is not None:
                targets.append(line.strip())
        rc = proc.wait()
    finally:
        timer.cancel()
    if killed:
        log.write(f"=== {step.name}: killed after its {step.timeout_s:.0f} s\n")
        rc = 124
    seconds = time.perf_counter() - t0
    return rc, seconds, targets


def versions() -> str:
    """torch, triton and the CUDA device, for the log's first line."""
    import torch  # noqa: PLC0415

    try:
        import triton  # noqa: PLC0415

        tri = triton.__version__
    except ImportError:
        tri = "absent"
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    return f"torch {torch.__version__}, triton {tri}, {cuda}"


def plan(parts: list[str], out: Path, smoke: bool) -> list[Step]:
    return [step for part in parts for step in PARTS[part](out, smoke)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", metavar="PART", help=f"some of {', '.join(PARTS)} (default: all, in that order)")
    p.add_argument("--out", type=Path, help="the folder every file goes into")
    p.add_argument("--smoke", action="store_true", help="the same steps at tiny sizes (CPU, tests)")
    p.add_argument("--list", action="store_true", help="print each part's steps and time limits, and run nothing")
    args = p.parse_args(argv)
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}: the parts are {', '.join(PARTS)}")
    parts = [x for x in PARTS if x in args.parts] if args.parts else list(PARTS)
    if args.list:
        for part in parts:
            limits = ", ".join(f"{s.name} {s.timeout_s:.0f} s" for s in PARTS[part](Path("OUT"), args.smoke))
            print(f"{part:<11} {limits}")
        total = sum(s.timeout_s for s in plan(parts, Path("OUT"), args.smoke))
        print(f"at most {total:.0f} s in all")
        return 0
    if args.out is None:
        p.error("--out is required")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (out / LOG).open("w") as log:
        header = f"{' '.join(parts)}{' --smoke' if args.smoke else ''}: {versions()}"
        print(header, flush=True)
        log.write(header + "\n")
        failed = False
        for step in plan(parts, out, args.smoke):
            if failed and step.if_previous_failed is not None:
                step.env.update(step.if_previous_failed)
                step.name += " (" + " ".join(f"{k}={v}" for k, v in step.if_previous_failed.items()) + ")"
            if args.smoke:
                step.env.setdefault("OMP_NUM_THREADS", "1")
            rc, seconds, targets = run_step(step, log, limited=not args.smoke)
            failed = rc != 0
            rows.append((step.name, "ok" if rc == 0 else f"exit {rc}", f"{seconds:.0f} s", junit_counts(step.junit)))
            rows += [summary_row(t) for t in targets]
        table = "\n".join(["", "=== summary", *("  ".join(c for c in r if c) for r in rows)])
        print(table, flush=True)
        log.write(table + "\n")
    shutil.rmtree(out / SCRATCH, ignore_errors=True)
    return 0 if all(r[1] in ("ok", "PASS", "FAIL", "UNMEASURED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
