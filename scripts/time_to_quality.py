"""Time to quality: the default head against its rival, trained side by side for the same
training time, with validation curves, and the time each needed to reach the other's final
validation MRR.

    uv run python scripts/time_to_quality.py --cases python_code,linux_source --seeds 0,1,2 --budget 60
    uv run python scripts/time_to_quality.py --mode same_steps --cases python_code --steps 2000
    uv run python scripts/time_to_quality.py --smoke            # seconds: the whole path on a tiny task

``equal_time`` (default): for each case and seed, the two heads of ``--heads`` (default: the
default head and the sampled softmax as the project tunes it, row-sparse under its lr) run as two
``lst-train`` processes AT THE SAME TIME, one torch thread each, same seed, so both see the same
load (``--apart``: one after the other, where the two do not fit in memory together, as at 10^7
on 24 GB). Each counts its budget on its own CPU time (``clock=cpu``, validation excluded): on a
shared machine the wall clock gives a run what the other jobs leave it, the CPU clock the same
work whatever the load. Each validates every ``--budget / --points`` seconds of that clock
(``train/clock_s``), and once more when its time is spent. A run's row: its final validation MRR
and top-10 error, steps, and ``reach_s``: the training time at which its curve (linear between
validations) first reached the rival's final MRR, ``reach_ratio`` = that over the rival's own
training time (below 1: it got there sooner; empty: never within its budget). The load average
while the pair ran is recorded (``load_mean``), and ``together`` (1: side by side, 0: ``--apart``).
A head variant may compile (``'default;compile=true;head.compile_step=true,sampled_softmax;compile=true'``: both sides
compiled, the default's own step and the body, the rival's forward, backward and row-sparse
update); each run then compiles cold, its tracing and code generation in its own process and in its
budget (``COMPILE_ENV``); the C++ compiler is a child process, which the CPU clock does not count.

``same_steps``: each head of ``--heads`` (default: the default, the sampled softmax, the full
softmax) for ``--steps`` steps, validating every ``--steps / --points`` steps: quality per step against the full
softmax's, the gold standard per step (two runs at a time; time plays no part).

Writes ``time_to_quality.csv`` (a row a run) and ``time_to_quality_curves.csv`` (a row a
validation) into ``--out`` or a fresh folder; ``--update-results`` appends to the committed ones
in benchmarks/results/ (page: docs/results/time_to_quality.md, scripts/results_pages.py).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import ROOT, add_output_args, output_dir, provenance, wrote




def synthetic(num_classes: int, train_size: int, val: int) -> list[str]:
    return ["data=synthetic", f"data.num_classes={num_classes}", f"data.input_vocab_size={num_classes}",
            f"data.train_size={train_size}", f"data.max_eval_examples={val}"]


#: a case -> (its data overrides, D). Evaluation ranks all D classes: fewer examples at larger D
#: keep a validation within seconds; the pair is compared on the same examples.
CASES = {
    "python_code": (["data=python_code", "data.max_eval_examples=1024"], 100_000),
    "linux_source": (["data=linux_source", "data.max_eval_examples=512"], 1_000_000),
    "wiki": (["data=wiki", "data.max_eval_examples=1024"], 10_000),  # the embedded corpus, as lst-train runs it
    "synthetic_1e5": (synthetic(100_000, 4_000_000, 1024), 100_000),
    "synthetic_1e6": (synthetic(1_000_000, 4_000_000, 512), 1_000_000),
    "synthetic_1e7": (synthetic(10_000_000, 4_000_000, 256), 10_000_000),
    "smoke": (synthetic(1_000, 20_000, 256), 1_000),
}
#: a head's name -> its overrides: the default is lst-train's own (S, mu, lr, P as the code sets them
#: by D); the sampled softmax as the project tunes it (head=sampled: row-sparse rows, S by D, its
#: swept lr); the full softmax; the levers measured against the default (docs/choosing_a_head.md);
#: the sampled softmax with P and SGD on its drawn rows
HEADS = {
    "default": [],
    "sampled_softmax": ["head=sampled"],
    "softmax": ["head=softmax"],
    "default_no_P": ["head.preconditioner=null"],
    "sampled_preconditioned": ["head=sampled_preconditioned"],
}
#: a run that compiles (``compile=true``, ``head.compile_step=true``) compiles cold (Inductor's caches
#: off: an earlier run's kernels are not reused), its code generation in its own process (no pool of
#: compile workers), so that Dynamo's and Inductor's time is on its CPU clock, in its budget; the C++
#: compiler Inductor calls is a child process, outside that clock
COMPILE_ENV = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
COMMON = ["trainer.max_epochs=1000", "trainer.limit_train_batches=1.0", "trainer.check_val_every_n_epoch=null",
          "test=false", "cpu_threads=1", "logger=csv", "callbacks.rich_progress=false", "~callbacks.checkpoint"]
RUN_COLUMNS = ["case", "D", "mode", "head", "rival", "seed", "clock", "budget_s", "steps", "train_s", "head_share",
               "val_examples",
               "val_mrr", "val_top10_error", "reach_s", "reach_ratio", "load_mean", "together", "machine", "torch", "commit",
               "date", "command"]
CURVE_COLUMNS = ["case", "D", "mode", "head", "seed", "step", "clock_s", "val_mrr", "val_top10_error", "machine",
                 "torch", "commit", "date", "command"]


def hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"00:{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def head_overrides(head: str) -> list[str]:
    """A head's overrides: a name of HEADS, or a variant of one, ``name;key=value;...`` (a
    setting tried against it: ``default;head.negatives.num=256;head.lr=8``)."""
    name, *extra = head.split(";")
    return [*HEADS[name], *extra]


def overrides(case: str, head: str, seed: int, mode: str, budget: float, points: int, steps: int) -> list[str]:
    data, _ = CASES[case]
    if mode == "equal_time":
        when = ["trainer.max_steps=-1", f"+trainer.max_time={hms(budget)}", "clock=cpu",
                f"trainer.val_check_interval={hms(max(1.0, budget / points))}"]
    else:
        when = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={max(1, steps // points)}"]
    return [*data, *COMMON, *when, f"seed={seed}", *head_overrides(head)]


def curve(run_dir: Path) -> list[dict]:
    """The run's validations in order: step, clock_s (its training clock; None without a budget),
    val_mrr, val_top10_error."""
    points = []
    with (run_dir / "csv" / "metrics.csv").open(newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("val/mrr") not in (None, ""):
                clock = row.get("train/clock_s")
                points.append({"step": int(float(row["step"])), "clock_s": float(clock) if clock else None,
                               "val_mrr": float(row["val/mrr"]), "val_top10_error": float(row["val/top10_error"])})
    return points


def time_to_reach(points: list[dict], target: float) -> float | None:
    """The training time at which the curve (linear between its validations, from the first)
    first reaches ``target`` MRR; None if it never does."""
    prev = None
    for p in points:
        if p["clock_s"] is None:
            continue
        if p["val_mrr"] >= target:
            if prev is None or p["val_mrr"] == prev["val_mrr"]:
                return p["clock_s"]
            f = (target - prev["val_mrr"]) / (p["val_mrr"] - prev["val_mrr"])
            return prev["clock_s"] + f * (p["clock_s"] - prev["clock_s"])
        prev = p
    return None


def launch(args_list: list[str], run_dir: Path) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("lst-train")
    cmd = [str(exe) if exe.exists() else "lst-train", *args_list, f"hydra.run.dir={run_dir}"]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    # a run that compiles does so cold, its code generation on its own CPU clock (COMPILE_ENV)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **COMPILE_ENV}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_all(procs: list[subprocess.Popen], run_dirs: list[Path]) -> list[float]:
    """Waits for every process (a failure is an error naming its log); returns the load averages seen."""
    loads = []
    while any(p.poll() is None for p in procs):
        loads.append(os.getloadavg()[0])
        time.sleep(2)
    for p, d in zip(procs, run_dirs):
        if p.returncode != 0:
            tail = (d.parent / f"{d.name}.log").read_text()[-3000:]
            raise RuntimeError(f"lst-train failed ({p.returncode}) in {d}:\n{tail}")
    return loads or [os.getloadavg()[0]]


def append_rows(path: Path, rows: list[dict], columns: list[str]) -> None:
    """Rows appended to a tidy CSV (its header written where it is new): the provenance columns last."""
    fresh = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        if fresh:
            w.writeheader()
        w.writerows(rows)


def command_of(words: list[str]) -> str:
    return "uv run lst-train " + " ".join(shlex.quote(w) for w in words)


def run_heads(words: dict, dirs: dict, apart: bool) -> list[float]:
    """The pair's runs side by side, or one after the other (``apart``); the load averages seen."""
    if not apart:
        return wait_all([launch(words[h], dirs[h]) for h in words], list(dirs.values()))
    return [load for h in words for load in wait_all([launch(words[h], dirs[h])], [dirs[h]])]


def val_examples(words: list[str]) -> int:
    """The validation examples a run's overrides ask for: Hydra's last override wins."""
    return [int(w.split("=")[1]) for w in words if w.startswith("data.max_eval_examples=")][-1]


def equal_time_pair(case: str, heads: list[str], seed: int, budget: float, points: int, work: Path,
                    info: dict, apart: bool = False) -> tuple[list[dict], list[dict]]:
    D = CASES[case][1]
    words = {h: overrides(case, h, seed, "equal_time", budget, points, 0) for h in heads}
    dirs = {h: work / f"{case}_{i}_s{seed}" for i, h in enumerate(heads)}
    loads = run_heads(words, dirs, apart)
    curves = {h: curve(dirs[h]) for h in heads}
    rows, curve_rows = [], []
    for h in heads:
        rival = next(r for r in heads if r != h)
        mine, theirs = curves[h], curves[rival]
        res = json.loads((dirs[h] / "results.json").read_text())
        reach = time_to_reach(mine, theirs[-1]["val_mrr"])
        rival_s = theirs[-1]["clock_s"]
        rows.append({"case": case, "D": D, "mode": "equal_time", "head": h, "rival": rival, "seed": seed,
                     "clock": "cpu", "budget_s": budget, "steps": res["train_steps"],
                     "head_share": round(res["head_share"], 3) if res.get("head_share") is not None else None,
                     "train_s": round(mine[-1]["clock_s"], 2),
                     "val_examples": val_examples(words[h]),
                     "val_mrr": round(mine[-1]["val_mrr"], 4), "val_top10_error": round(mine[-1]["val_top10_error"], 4),
                     "reach_s": None if reach is None else round(reach, 2),
                     "reach_ratio": None if reach is None else round(reach / rival_s, 3),
                     "load_mean": round(sum(loads) / len(loads), 2), "together": int(not apart), **info,
                     "command": command_of(words[h])})
        curve_rows += [{"case": case, "D": D, "mode": "equal_time", "head": h, "seed": seed,
                        "step": p["step"], "clock_s": round(p["clock_s"], 2), "val_mrr": round(p["val_mrr"], 4),
                        "val_top10_error": round(p["val_top10_error"], 4), **info, "command": command_of(words[h])}
                       for p in mine]
    return rows, curve_rows


def same_steps(case: str, heads: list[str], seed: int, steps: int, points: int, work: Path,
               info: dict) -> tuple[list[dict], list[dict]]:
    D = CASES[case][1]
    rows, curve_rows = [], []
    for i in range(0, len(heads), 2):  # two at a time: time plays no part here
        batch = heads[i:i + 2]
        words = {h: overrides(case, h, seed, "same_steps", 0, points, steps) for h in batch}
        dirs = {h: work / f"{case}_{i + j}_s{seed}_steps" for j, h in enumerate(batch)}
        procs = [launch(words[h], dirs[h]) for h in batch]
        loads = wait_all(procs, list(dirs.values()))
        for h in batch:
            pts = curve(dirs[h])
            res = json.loads((dirs[h] / "results.json").read_text())
            rows.append({"case": case, "D": D, "mode": "same_steps", "head": h, "rival": "softmax", "seed": seed,
                         "clock": "", "budget_s": None, "steps": res["train_steps"], "train_s": None,
                         "head_share": round(res["head_share"], 3) if res.get("head_share") is not None else None,
                         "val_examples": val_examples(words[h]),
                         "val_mrr": round(pts[-1]["val_mrr"], 4), "val_top10_error": round(pts[-1]["val_top10_error"], 4),
                         "reach_s": None, "reach_ratio": None, "load_mean": round(sum(loads) / len(loads), 2), "together": 1,
                         **info, "command": command_of(words[h])})
            curve_rows += [{"case": case, "D": D, "mode": "same_steps", "head": h, "seed": seed, "step": p["step"],
                            "clock_s": None, "val_mrr": round(p["val_mrr"], 4),
                            "val_top10_error": round(p["val_top10_error"], 4), **info, "command": command_of(words[h])}
                           for p in pts]
    return rows, curve_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["equal_time", "same_steps"], default="equal_time")
    p.add_argument("--cases", default="python_code,linux_source", help=f"comma-separated, of {sorted(CASES)}")
    p.add_argument("--heads", default=None, help=f"comma-separated, of {sorted(HEADS)} or a variant 'name;key=value;...' (equal_time: two; default: "
                                                 "default,sampled_softmax; same_steps: default,sampled_softmax,softmax)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget", type=float, default=60.0, help="equal_time: training seconds of CPU time a run")
    p.add_argument("--points", type=int, default=6, help="validations during a run (and one at its end)")
    p.add_argument("--steps", type=int, default=2000, help="same_steps: training steps a run")
    p.add_argument("--apart", action="store_true", help="equal_time: the pair's runs one after the other, where two "
                                                       "do not fit in memory together (synthetic_1e7 on 24 GB)")
    p.add_argument("--smoke", action="store_true", help="a few seconds on a tiny synthetic task")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.cases, args.seeds, args.budget, args.points, args.steps = "smoke", "0", 3.0, 3, 12
    cases = args.cases.split(",")
    heads = (args.heads.split(",") if args.heads else
             ["default", "sampled_softmax"] + (["softmax"] if args.mode == "same_steps" else []))
    for name in (*cases, *heads):
        if name not in CASES and name.split(";")[0] not in HEADS:
            raise SystemExit(f"unknown case or head {name!r}: cases {sorted(CASES)}, heads {sorted(HEADS)}")
    if args.mode == "equal_time" and len(heads) != 2:
        raise SystemExit("equal_time runs a pair: --heads A,B")
    out = output_dir(args, "time_to_quality")
    info = provenance()
    runs_csv, curves_csv = out / "time_to_quality.csv", out / "time_to_quality_curves.csv"
    with tempfile.TemporaryDirectory(prefix="ttq_") as tmp:
        for case in cases:
            for seed in (int(s) for s in args.seeds.split(",")):
                if args.mode == "equal_time":
                    rows, curve_rows = equal_time_pair(case, heads, seed, args.budget, args.points, Path(tmp), info,
                                                       args.apart)
                else:
                    rows, curve_rows = same_steps(case, heads, seed, args.steps, args.points, Path(tmp), info)
                # appended as each pair ends: a long grid stopped part-way keeps what it measured
                append_rows(runs_csv, rows, RUN_COLUMNS)
                append_rows(curves_csv, curve_rows, CURVE_COLUMNS)
                for r in rows:
                    print(f"{case} seed {seed} {r['head']}: MRR {r['val_mrr']} top-10 error {r['val_top10_error']} "
                          f"steps {r['steps']} reach_ratio {r['reach_ratio']} load {r['load_mean']}", flush=True)
    wrote(runs_csv, curves_csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
