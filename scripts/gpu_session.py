"""The GPU session, as two calls of the device tool on one warm machine (docs/benchmarks.md,
"The GPU session: two calls"): a lease is 15 minutes of device time, the machine's start
included. Each call runs its steps one after the other, each in its own process (a CUDA
error in one does not poison the next), tees their output into ``<call>_log.txt`` in the
output folder and ends that log with a table: each step's exit status and time, the tests'
counts from their junit XML, and every PASS / FAIL / UNMEASURED target line the benchmarks
printed.

    python3 scripts/gpu_session.py call1 --out $OUT   # -m gpu and kernel tests natively, bench_heads.py
    python3 scripts/gpu_session.py call2 --out $OUT   # bench_whole_step.py --device cuda, quality at D = 10^6

``--smoke`` runs the same steps at tiny sizes on whatever device is there (CPU in the test
suite, tests/scripts/test_gpu_session.py). Every file a call writes lies directly in
``--out`` (the device tool brings back at most 8 files): call1 6, call2 8.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# The test paths of call 1 that collect without the app's frameworks (hydra, wandb, datasets
# are not on the GPU machine): every gpu-marked test of the suite lies in them.
GPU_TEST_PATHS = ["tests/spherical", "tests/baselines", "tests/heads", "tests/lst_kernels",
                  "tests/scripts/test_bench_whole_step.py"]
# The cubin compile of every launch is checked on the CPU by the suite; on the GPU the kernels run.
NOT_ON_THE_GPU = "tests/lst_kernels/test_compile_for_gpu.py"
# The heads at D = 10^6 in the quality comparison (quality_table.py names), the contested ones
# first (the default head, its step replayed from a CUDA graph by head.step=auto, with its Neumann
# factors fixed and adaptive (Stabiliser.neumann; the eager step, host-bound, was measured in four
# sessions: quality_table.py's factored-sampled-eager), and the sampled softmax: issue 31's
# question), so that a step cut short by its limit loses the least telling
# rows (on the H100, 26 Nov, each run took 35-40 s with its start, and the sampled softmax, then
# last, was cut).
QUALITY_HEADS = ["factored-sampled", "factored-sampled-adaptive", "sampled-log_uniform", "adaptive", "softmax",
                 "factored-zloss", "hsoftmax"]
TARGET = re.compile(r"^(PASS|FAIL|UNMEASURED)\s+(.*)$")


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
    """pytest-xdist's ``-n`` where it is installed (the GPU machine has it; the project's venv
    does not): the kernel tests' Triton compiles spread over the machine's cores."""
    return ["-n", str(n)] if importlib.util.find_spec("xdist") else []


def pytest_argv(paths: list[str], junit: Path, *extra: str) -> list[str]:
    # -o addopts= drops the suite's default "-m 'not slow' --durations=30"; -p no:cacheprovider
    # writes no .pytest_cache into the checkout; -rA names every test with its outcome in the log.
    return [PY, "-m", "pytest", *paths, "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
            "--import-mode=importlib", f"--junitxml={junit}", *extra]


def call1(out: Path, smoke: bool) -> list[Step]:
    """Correct, then fast: the gpu-marked tests, the kernel tests natively (every kernel against
    its reference in float32, float64 and bf16, odd shapes, repeated classes), the default
    head's step profiled (profile_step.py, its graph at 2 and 6 Neumann factors side by side), then
    bench_heads.py: a smoke run of the factored paths (the Triton compiles), then the sizes of
    the targets (D = 10^4, 793 471 and 2 x 10^7 at d = 512, the paper's d = 300)."""
    # smoke: one file of each (collecting every path costs 20 s here), a few kernel cases
    gpu = pytest_argv(["tests/spherical/test_cuda.py"] if smoke else GPU_TEST_PATHS, out / "call1_gpu_junit.xml",
                      "-m", "gpu", *workers(4))
    kernels = pytest_argv(["tests/lst_kernels/test_gather_dot_kernel.py"] if smoke else ["tests/lst_kernels"],
                          out / "call1_kernels_junit.xml", "-m", "not slow", "--deselect", NOT_ON_THE_GPU,
                          *(["-k", "shape1"] if smoke else workers(8)))
    bench = [PY, "scripts/bench_heads.py"]
    factored = ["--heads", "factored/zloss,factored_sync,factored_graph"]
    tests = [Step("gpu_tests", gpu, 80, junit=out / "call1_gpu_junit.xml"),
             Step("kernel_tests", kernels, 40, junit=out / "call1_kernels_junit.xml")]
    # the default head's step profiled (lst-train's loss=sampled with its negatives and P), the
    # graph and the sync-free step at 2 and at 6 Neumann factors side by side (what neumann=adaptive
    # saves where a trained model's rho asks for 2): its tables go into the log
    profile = [PY, "scripts/profile_step.py", "--loss", "sampled", "--inverse", "products", "--factors", "2,6"]
    if smoke:
        return [*tests, Step("profile_step", [*profile, "--smoke", "--out", tempfile.mkdtemp()], 60),
                Step("bench_heads", [*bench, "--smoke", "--D", "50", "--out", str(out)], 120)]
    scratch = Path(tempfile.mkdtemp(prefix="bench_heads_smoke_"))
    return [*tests, Step("profile_step", [*profile, "--out", str(scratch)], 50),
            Step("bench_heads_smoke", [*bench, "--smoke", *factored, "--out", str(scratch)], 40),
            # the smoke run failed (the machine's Triton, say): the factored head on its torch ops
            Step("bench_heads", [*bench, "--D", "10000,793471,20000000", "--d", "512,300", "--m", "128,1024",
                                 "--all-losses-up-to", "10000", "--budget-s", "0.1", "--deadline-s", "120",
                                 "--out", str(out)], 150, if_previous_failed={"LST_KERNELS": "torch"})]


def call2(out: Path, smoke: bool) -> list[Step]:
    """The whole step on the GPU (D = 793 471 and 10^6: the ratios to the full and hierarchical
    softmax, the flatness pair), then every head at D = 10^6 for the same training time,
    validation curves against training wall-clock."""
    whole = [PY, "scripts/bench_whole_step.py", "--out", str(out)]
    quality = [PY, "scripts/quality_table.py", "--tasks", "synthetic", "--modes", "budget", "--budget-clock",
               "train", "--stem", "quality_large_D", "--out", str(out)]
    if smoke:
        whole += ["--smoke", "--D", "50", "--bodies", "ngram_mlp", "--heads", "softmax"]
        quality += ["--preset", "quick", "--budget-s", "1", "--heads", "factored-zloss"]
        return [Step("whole_step", whole, 120), Step("quality_large_D", quality, 180)]
    # 793 471: the ratios to the full and hierarchical softmax; 10^6: the flatness pair (its
    # D = 10^4 model is built beside it). 2 048 tokens a step: at the CPU's 256 every head's
    # whole step was launch-bound on the H200 (4-10 ms, 26 Nov); files whole_step_tokens2048_*
    whole += ["--device", "cuda", "--tokens", "2048", "--D", "793471,1000000", "--all-losses-up-to", "0",
              "--budget-s", "0.3", "--deadline-s", "75"]
    quality += ["--preset", "large_D", "--budget-s", "15", "--val-every-s", "5", "--heads", *QUALITY_HEADS,
                "-o", "trainer=gpu"]
    return [Step("whole_step", whole, 110), Step("quality_large_D", quality, 260)]


CALLS = {"call1": call1, "call2": call2}


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


def run_step(step: Step, log) -> tuple[int, float, list[str]]:
    """Run one step, its output to the console and the log; (exit status, seconds, target lines)."""
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
    timer.start()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            log.flush()  # what a cut-off call returns is what reached the file
            if TARGET.match(line.strip()):
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("call", choices=sorted(CALLS))
    p.add_argument("--out", type=Path, required=True, help="the folder every file goes into ($OUT on the GPU)")
    p.add_argument("--smoke", action="store_true", help="the same steps at tiny sizes (CPU, tests)")
    args = p.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = CALLS[args.call](out, args.smoke)
    rows = []
    with (out / f"{args.call}_log.txt").open("w") as log:
        header = f"{args.call}{' --smoke' if args.smoke else ''}: {versions()}"
        print(header, flush=True)
        log.write(header + "\n")
        failed = False
        for step in steps:
            if failed and step.if_previous_failed is not None:
                step.env.update(step.if_previous_failed)
                step.name += " (" + " ".join(f"{k}={v}" for k, v in step.if_previous_failed.items()) + ")"
            rc, seconds, targets = run_step(step, log)
            failed = rc != 0
            rows.append((step.name, "ok" if rc == 0 else f"exit {rc}", f"{seconds:.0f} s", junit_counts(step.junit)))
            rows += [("  target", t.split()[0], "", " ".join(t.split()[1:])) for t in targets]
        table = "\n".join(["", f"=== {args.call} summary", *("  ".join(c for c in r if c) for r in rows)])
        print(table, flush=True)
        log.write(table + "\n")
    return 0 if all(r[1] in ("ok", "PASS", "FAIL", "UNMEASURED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
