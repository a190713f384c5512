"""The quality table: every head trained on the same data with the same body, for the same
number of epochs and for the same wall-clock budget; top-k error rates, MRR, perplexity
where defined, SimLex-999, step time. Writes a CSV, a markdown table and a plot of a top-k
error against training wall-clock time, named after the machine, into a fresh run
directory (``--out DIR``; ``--update-results``: into benchmarks/results/).

    uv run python scripts/quality_table.py                       # both tasks, both budgets
    uv run python scripts/quality_table.py --preset quick --budget-s 10   # a smoke test, minutes
    uv run python scripts/quality_table.py --tasks wiki --heads softmax factored-zloss \\
        --epochs 1 --budget-s 60 -o trainer.limit_train_batches=500
    # quality at large D: synthetic D = 1 000 000, 150 s of training per head (evaluation
    # excluded), a validation on 512 fixed held-out examples every 30 s of it
    uv run python scripts/quality_table.py --preset large_D --tasks synthetic --modes budget \
        --budget-s 150 --budget-clock train --val-every-s 30 --stem quality_large_D \
        --heads factored-zloss softmax hsoftmax adaptive sampled-log_uniform

``--merge`` keeps the rows of the table already in the output folder that this run does
not redo (with ``--update-results``: the committed table; with ``--out DIR``: an earlier
run's). Each run is ``lst_lightning.app.train.run`` on a composed config (``data=<task>``, ``head=...``,
any ``-o`` overrides), so what is measured is exactly what ``lst-train`` does.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import multiprocessing
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from pathlib import Path

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import (add_output_args, machine_name, markdown_table, output_dir, pyplot, save_figure, write_csv,
                      wrote)

from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Timer

from lst_lightning.app.callbacks import TrainingClock
from lst_lightning.app.configs import config_dir
from lst_lightning.app.train import run

# name -> Hydra overrides. The factored head with each spherical loss, the naive spherical
# head, and the baselines (each sampler of the sampled softmax).
HEADS: dict[str, list[str]] = {
    **{f"factored-{loss}": ["head=factored", f"loss={loss}"]
       for loss in ("zloss", "spherical_softmax", "taylor_softmax", "mse")},
    "naive-zloss": ["head=naive", "loss=zloss"],
    # sampled classes inside the exact step: the composite loss and the head's negatives
    # (head.step=auto: on one GPU its step replayed from a CUDA graph, the draw inside; app/step_choice.py)
    "factored-sampled": ["head=factored", "loss=sampled"],
    # the same head's eager step (on the CPU, what auto chooses anyway)
    "factored-sampled-eager": ["head=factored", "loss=sampled", "head.step=autograd"],
    # with the Neumann factors of the GPU's step read from its rho every sync (opt-in until timed)
    "factored-sampled-adaptive": ["head=factored", "loss=sampled", "head.stabiliser.neumann=adaptive"],
    "softmax": ["head=softmax"],
    "hsoftmax": ["head=hsoftmax"],
    "adaptive": ["head=adaptive"],
    "sampled-uniform": ["head=sampled", "head.sampler=uniform"],
    "sampled-log_uniform": ["head=sampled", "head.sampler=log_uniform"],
    "sampled-unigram": ["head=sampled_unigram"],
    "sampled-rff": ["head=sampled_rff"],
    "sampled-quadratic": ["head=sampled_quadratic"],
    # its drawn rows stepped by SGD with the exact head's right preconditioner (static rows: compiled on a GPU)
    "sampled-preconditioned": ["head=sampled_preconditioned"],
}
TASKS = {"wiki": ["data=wiki"], "synthetic": ["data=synthetic"]}
# Per-task overrides of a preset: "quick" runs in seconds per head (a smoke test of the table).
PRESETS = {
    "full": {"wiki": [], "synthetic": []},
    "quick": {"wiki": ["experiment=tiny"],
              "synthetic": ["experiment=tiny", "~data.vocab_size", "data.num_classes=3000",
                            "data.input_vocab_size=500", "data.context_size=3"]},
    # D = 10^6 classes and input tokens: evaluation scores every example against all D
    # classes, so it runs on a small fixed held-out set, in batches whose D-wide scores fit.
    # The real corpus at its own D (every word of the embedded extract: ~32k).
    "large_D": {"wiki": ["data.vocab_size=null", "data.max_eval_examples=2048", "test=false"],
                "synthetic": ["data.num_classes=1000000", "data.input_vocab_size=1000000",
                              "data.max_eval_examples=512", "data.eval_batch_size=128", "test=false"]},
}


class ValidationCurve(TrainingClock):
    """(training seconds, step, val metrics) at every validation; validation time excluded.
    With ``budget_s``: the app's training clock with that budget, so training stops once that
    many training seconds have passed (a head whose evaluation is slow gets the same training
    time as the others) and the app's schedule (``scheduler.over=budget``) decays over them."""

    def __init__(self, budget_s: float | None = None):
        super().__init__(duration=None if budget_s is None else timedelta(seconds=budget_s))
        self.points: list[dict] = []

    @property
    def state_key(self) -> str:  # beside the Timer of --budget-clock wall
        return "ValidationCurve"

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            val = {k[4:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            self.points.append({"train_s": self.time_elapsed(), "step": trainer.global_step, **val})
        super().on_validation_end(trainer, pl_module)


def run_one(task: str, head: str, mode: str, args, out_dir: Path) -> dict:
    overrides = [*TASKS[task], *HEADS[head], f"seed={args.seed}", "logger=csv", "callbacks=minimal",
                 f"name={task}-{head}-{mode}"]
    if args.val_every:
        overrides.append(f"trainer.val_check_interval={args.val_every}")
    elif args.val_every_s:  # Lightning's clock here excludes validation too
        overrides.append(f"trainer.val_check_interval={duration(args.val_every_s)}")
    if mode == "epochs":
        overrides.append(f"trainer.max_epochs={args.epochs}")
    else:
        overrides += [f"trainer.max_epochs={args.max_epochs_in_budget}"]

    overrides += PRESETS[args.preset][task] + args.override + task_overrides(args.task_override, task)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    curve = ValidationCurve(args.budget_s if mode == "budget" and args.budget_clock == "train" else None)
    # wall: Lightning's own Timer, whose time includes the validation passes inside training
    wall = [Timer(duration=timedelta(seconds=args.budget_s))] \
        if mode == "budget" and args.budget_clock == "wall" else []
    res = run(cfg, out_dir / f"{task}-{head}-{mode}", extra_callbacks=[curve, *wall])
    test = res.get("test", res["val"])
    row = {"task": task, "head": head, "mode": mode, **budget_of(mode, args), "num_classes": res["num_classes"],
           "train_steps": res["train_steps"], "step_time_ms": res.get("step_time_ms"),
           "head_share": res.get("head_share"), "wall_s": res["wall_s"]}
    row.update({k: test[k] for k in sorted(test) if "error" in k or k in ("mrr", "perplexity", "simlex_rho")})
    row["curve"] = curve.points
    return row


def budget_of(mode: str, args) -> dict:
    """A row's budget (``budget_s``) and its clock in budget mode; nothing in epochs mode."""
    return {"budget_s": args.budget_s, "clock": args.budget_clock} if mode == "budget" else {}


def run_apart(task: str, head: str, mode: str, args, out_dir: Path) -> dict:
    """``run_one`` in a fresh process: each run starts with the machine's memory free. In one
    process a D = 10^7 table lost its third head to the kernel's OOM killer, the second's
    15 GB (its W and SparseAdam's moments) not yet given back, and with it every row after."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(run_one, task, head, mode, args, out_dir).result()


def duration(seconds: float) -> str:
    """Lightning's DD:HH:MM:SS for a number of seconds (at least 1)."""
    s = max(1, int(seconds))
    return f"00:{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def task_overrides(specs: list[str], task: str) -> list[str]:
    """The Hydra overrides of ``--task-override TASK:OVERRIDE`` that apply to ``task``."""
    out = []
    for spec in specs:
        name, sep, override = spec.partition(":")
        if not sep or name not in TASKS or not override:
            raise ValueError(f"--task-override wants TASK:OVERRIDE with TASK in {list(TASKS)}, got {spec!r}")
        if name == task:
            out.append(override)
    return out


def plot(rows: list[dict], metric: str, path: Path, machine: str) -> Path:
    tasks = sorted({r["task"] for r in rows})
    fig, axes = pyplot().subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in rows:
            pts = [p for p in r["curve"] if metric in p]
            if r["task"] != task or r["mode"] != "budget" or not pts:
                continue
            style = "-" if r["head"].startswith(("factored", "naive")) else "--"
            ax.plot([p["train_s"] for p in pts], [p[metric] for p in pts], style, marker=".", label=r["head"])
        sizes = sorted({r["num_classes"] for r in rows if r["task"] == task and r.get("num_classes")})
        d = f" (D = {', '.join(f'{n:,}' for n in sizes)})" if sizes else ""
        ax.set_title(f"{task}{d}: validation {metric} vs training time", fontsize=9)
        ax.set_xlabel("training wall-clock (s, validation excluded)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(machine, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def previous_rows(folder: Path, machine: str, rerun: set[tuple[str, str, str]],
                  name: str = "quality_table") -> list[dict]:
    """Rows of this machine's table (CSV and curves) in ``folder`` except the (task, mode, head)
    in ``rerun``: ``--merge``."""
    stem = folder / f"{name}_{machine}"
    curves_path = stem.parent / (stem.name + "_curves.json")
    if not stem.with_suffix(".csv").exists() or not curves_path.exists():
        return []
    curves = {(c["task"], c["head"], c["mode"]): c["curve"] for c in json.loads(curves_path.read_text())}
    rows = []
    with open(stem.with_suffix(".csv"), newline="") as f:
        for r in csv.DictReader(f):
            if (r["task"], r["mode"], r["head"]) in rerun:
                continue
            row = {}
            for k, v in r.items():
                if k == "machine" or v == "":
                    continue
                try:
                    row[k] = int(v) if v.lstrip("-").isdigit() else float(v)
                except ValueError:
                    row[k] = v
            row["curve"] = curves.get((r["task"], r["head"], r["mode"]), [])
            rows.append(row)
    return rows


def write_results(rows: list[dict], metric: str, machine: str, folder: Path,
                  name: str = "quality_table") -> tuple[str, Path]:
    """CSV, validation curves (JSON), markdown table and plot in ``folder``."""
    stem = folder / f"{name}_{machine}"
    metric_cols = sorted({k for r in rows for k in r if "error" in k and k != "error"},
                         key=lambda k: (len(k), k))
    cols = ["task", "mode", "budget_s", "clock", "head", "num_classes", "train_steps", *metric_cols, "mrr", "perplexity",
            "simlex_rho", "step_time_ms", "head_share", "wall_s"]
    if any("error" in r for r in rows):
        cols.append("error")
    write_csv(stem.with_suffix(".csv"), rows, cols, machine=machine)
    (stem.parent / (stem.name + "_curves.json")).write_text(
        json.dumps([{k: r[k] for k in ("task", "head", "mode", "curve")} for r in rows], indent=1))
    md = f"Machine: {machine}\n\n" + markdown_table(rows, cols) + "\n"
    stem.with_suffix(".md").write_text(md)
    plot(rows, metric, stem.with_suffix(".png"), machine)
    return md, stem


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--modes", nargs="+", default=["epochs", "budget"], choices=["epochs", "budget"])
    ap.add_argument("--preset", choices=list(PRESETS), default="full",
                    help="full: the configs as they are; quick: tiny sizes, seconds per run")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget per run (budget mode)")
    ap.add_argument("--max-epochs-in-budget", type=int, default=1000)
    ap.add_argument("--val-every", type=int, default=0, help="validate every N training batches (0: per epoch)")
    ap.add_argument("--val-every-s", type=float, default=0.0,
                    help="validate every S seconds of training (validation excluded; 0: per epoch)")
    ap.add_argument("--budget-clock", choices=["wall", "train"], default="wall",
                    help="budget mode: wall: Lightning's Timer (validation included); train: training time "
                         "only, validation excluded, as lst-train's trainer.max_time (fair when evaluation is "
                         "slow, e.g. at large D)")
    ap.add_argument("--stem", default="quality_table", help="file names: <stem>_<machine>.{csv,md,png}")
    ap.add_argument("--metric", default="top10_error", help="metric of the plot")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--override", action="append", default=[], help="extra Hydra override (repeatable)")
    ap.add_argument("-t", "--task-override", action="append", default=[],
                    help="Hydra override for one task only, as TASK:OVERRIDE (repeatable)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of this machine's table in the output folder (--out DIR, or the "
                         "committed one with --update-results) that this run does not redo")
    ap.add_argument("--runs-dir", default=None,
                    help="where run directories go, kept (default: a temporary folder, removed at the end)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.merge and not (args.out or args.update_results):
        ap.error("--merge keeps the rows of an earlier table: name its folder with --out DIR, "
                 "or merge into the committed table with --update-results")

    machine = machine_name()
    task_overrides(args.task_override, "wiki")  # bad input fails before any run, not after an hour
    folder = output_dir(args, "quality_table")
    with contextlib.ExitStack() as scratch:  # the runs' folders kept only where --runs-dir names one
        out_dir = Path(args.runs_dir or scratch.enter_context(tempfile.TemporaryDirectory(prefix="quality_table_")))
        rerun = {(t, m, h) for t in args.tasks for m in args.modes for h in args.heads}
        rows = previous_rows(folder, machine, rerun, args.stem) if args.merge else []
        for task in args.tasks:
            for mode in args.modes:
                for head in args.heads:
                    try:
                        rows.append(run_apart(task, head, mode, args, out_dir))
                    except Exception as exc:  # one head failing must not lose the others' results
                        print(f"!! {task}/{head}/{mode} failed: {type(exc).__name__}: {exc}")
                        rows.append({"task": task, "head": head, "mode": mode, **budget_of(mode, args),
                                     "error": f"{type(exc).__name__}: {exc}", "curve": []})
                    # after every run, so that a run cut short still leaves its table
                    md, stem = write_results(rows, args.metric, machine, folder, args.stem)
        print(md)
        wrote(*(stem.with_suffix(s) for s in (".csv", ".md", ".png")), stem.parent / (stem.name + "_curves.json"))
    if args.runs_dir:
        print(f"run directories in {out_dir}")
    # every run's row is written; a run that failed makes the exit status 1 (a suite says so)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
