"""What checkpoints cost the training step, by D: ``lst-train`` with each checkpoint setting
against none, and what the head's recomputable state would save.

    uv run python scripts/bench_checkpoints.py [--D 10000 1000000 10000000] [--smoke]

For every D and setting, two runs of ``lst-train`` on the synthetic task (input vocabulary =
D up to ``--max-input-vocab``, no validation, no test) of ``--short`` and ``--long`` optimizer
steps, one after the other in child processes; the per-step time is the difference of their
wall times over the difference of their steps, so that start-up, the data and the final
save cancel (the method of issue "Checkpoints off the critical path"). ``--repeats N``: N
rounds of all settings in turn, each setting's figure the median of its rounds. The long run
also reports its periodic saves' cost measured inside it (results.json "checkpoints"): how
many, the seconds they held training, the seconds until each was on disk, and the larger over
the training's wall time (``in_run_share``, what ``max_overhead`` bounds; no difference of
wall times across runs). Settings:

- ``none``: no periodic checkpoint (the final save only, in both runs);
- ``default``: the shipped defaults (every 10 minutes, after validation, max_overhead 0.05,
  asynchronous); with no validation here, it saves nothing periodic in a run under 10 minutes;
- ``budget``: the defaults with a trigger every 0.6 s, so that only the 5 % bound spaces
  the saves: what the default rule costs when saves are due all the time;
- ``steps1000_sync``: every 1 000 steps, each save written before training goes on;
- ``steps1000_async``: the same, written in the background.

Then, per D, the cost of recomputing what the factored head could leave out of a checkpoint
(Q = W^T W, wbar = W^T 1 and U^-1 from V, U and omega: ``refresh_bookkeeping``, O(D d^2))
against the bytes it takes. Writes ``checkpoints_<machine>.csv``, ``.md`` and ``.png``
into a fresh run directory (``--out DIR``; ``--update-results``: benchmarks/results/, where
``--series LABEL`` appends the rows, labelled, to the CSV's earlier series).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import (add_output_args, machine_name, markdown_table, output_dir, positive_int, pyplot, save_figure,
                      write_csv, wrote)

import torch

OFF = ["callbacks.checkpoint.every_n_steps=0", "callbacks.checkpoint.every_minutes=null",
       "callbacks.checkpoint.after_validation=false"]
SETTINGS = {
    "none": OFF,
    "default": [],
    "budget": ["callbacks.checkpoint.every_minutes=0.01"],
    "steps1000_sync": ["callbacks.checkpoint.every_n_steps=1000", "callbacks.checkpoint.every_minutes=30",
                       "callbacks.checkpoint.max_overhead=null", "callbacks.checkpoint.asynchronous=false"],
    "steps1000_async": ["callbacks.checkpoint.every_n_steps=1000", "callbacks.checkpoint.every_minutes=30",
                        "callbacks.checkpoint.max_overhead=null"],
}
SMOKE = dict(D=[300], short=2, long=6, settings=["none", "steps1000_async"], hidden_dim=8)


def train(run_dir: Path, D: int, steps: int, setting: str, args) -> dict:
    """One lst-train run in a child process; its wall time, steps and checkpoint size."""
    # max_epochs=-1: the trainer's 2 epochs of 2 000 batches would end a longer run at 4 000 steps
    overrides = ["data=synthetic", f"data.num_classes={D}", f"data.input_vocab_size={min(D, args.max_input_vocab)}",
                 f"trainer.max_steps={steps}", "trainer.max_epochs=-1", "trainer.limit_val_batches=0", "test=false",
                 "logger=csv", "callbacks=minimal", f"hydra.run.dir={run_dir}", *SETTINGS[setting], *args.overrides]
    if args.hidden_dim:
        overrides.append(f"model.hidden_dim={args.hidden_dim}")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lst_lightning.app.train", *overrides],
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"lst-train failed ({setting}, D={D}, {steps} steps):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    res = json.loads((run_dir / "results.json").read_text())
    if res["train_steps"] != steps:
        raise RuntimeError(f"lst-train stopped at {res['train_steps']} of {steps} steps ({setting}, D={D}): "
                           "an override ends the run before the steps asked for")
    last = run_dir / "checkpoints" / "last.ckpt"
    saves = len(list((run_dir / "checkpoints").glob("step*.ckpt")))
    return {"wall_s": wall, "steps": res["train_steps"], "ckpt_mb": last.stat().st_size / 2**20 if last.exists() else 0,
            "step_files": saves, "in_run": res.get("checkpoints") or {}}


def recompute_cost(D: int, hidden_dim: int) -> dict:
    """Seconds to recompute Q, wbar and U^-1 of a factored head of D classes, and their bytes."""
    from lst_lightning.spherical import FactoredSphericalHead
    head = FactoredSphericalHead(num_classes=D, hidden_dim=hidden_dim, loss="zloss", bias=True)
    start = time.perf_counter()
    head.refresh_bookkeeping()
    torch.linalg.inv(head.U)
    seconds = time.perf_counter() - start
    small = sum(t.numel() * t.element_size() for t in (head.Q, head.wbar, head.Uinv))
    return {"recompute_s": seconds, "recomputable_bytes": small, "V_mb": head.V.numel() * head.V.element_size() / 2**20}


def measured(step_ms: float) -> float | None:
    """A step's time from the difference of two runs' wall times, or None where that difference is
    not positive: the long run was no slower than the short one, so the runs' noise (a start's
    imports, another job on the machine) outweighed their extra steps; a longer --long measures."""
    if step_ms > 0:
        return step_ms
    print(f"a step's time of {step_ms:.1f} ms is below the runs' noise: not written (raise --long)", flush=True)
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--D", type=positive_int, nargs="+", default=[10_000, 1_000_000, 10_000_000])
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--short", type=positive_int, default=20)
    ap.add_argument("--long", type=positive_int, default=1020)
    ap.add_argument("--max-input-vocab", type=positive_int, default=1_000_000,
                    help="the input vocabulary is min(D, this): at 10^7 a D-row input embedding and its two "
                         "SparseAdam moments would not fit a 24 GB machine beside V")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="rounds of every setting, interleaved (none, default, ..., none, default, ...); each "
                         "setting's figure is the median of its rounds, so a change of load falls on all alike")
    ap.add_argument("--hidden-dim", type=positive_int, default=None)
    ap.add_argument("--series", default=None,
                    help="a label for this measurement's rows (column 'series'); with --update-results they are "
                         "appended to this machine's committed CSV, which keeps every earlier series")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, two settings, in seconds (tests); options given still count")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    add_output_args(ap)
    if ap.parse_known_args(argv)[0].smoke:  # tiny defaults
        ap.set_defaults(**SMOKE)
    args = ap.parse_args(argv)
    if args.long <= args.short:
        ap.error(f"--long ({args.long}) must exceed --short ({args.short}): a step's time is the difference of "
                 "their wall times over the difference of their steps")
    out, machine = output_dir(args, "bench_checkpoints"), machine_name()
    csv_path, append = out / f"checkpoints_{machine}.csv", bool(args.series and args.update_results)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # a first start reads torch, Lightning and the data from a cold cache: seconds that
        # would fall on the first setting's short run alone
        train(Path(tmp) / "warm_up", args.D[0], args.short, args.settings[0], args)
        for D in args.D:
            runs = {setting: [] for setting in args.settings}
            for rnd in range(args.repeats):
                for setting in args.settings:
                    a = train(Path(tmp) / f"{D}_{setting}_{rnd}_short", D, args.short, setting, args)
                    b = train(Path(tmp) / f"{D}_{setting}_{rnd}_long", D, args.long, setting, args)
                    runs[setting].append((1e3 * (b["wall_s"] - a["wall_s"]) / (b["steps"] - a["steps"]), a, b))
                    print({"D": D, "setting": setting, "round": rnd, "step_ms": round(runs[setting][-1][0], 3)},
                          flush=True)
            base = measured(statistics.median(ms for ms, _, _ in runs["none"])) if "none" in runs else None
            for setting, done in runs.items():
                step_ms = measured(statistics.median(ms for ms, _, _ in done))
                _, a, b = done[-1]
                rows.append({**({"series": args.series} if args.series else {}),
                             "D": D, "setting": setting, "step_ms": None if step_ms is None else round(step_ms, 3),
                             "ratio_to_none": round(step_ms / base, 3) if base and step_ms is not None else None,
                             "rounds_ms": " ".join(f"{ms:.2f}" for ms, _, _ in done),
                             "short_wall_s": round(a["wall_s"], 2), "long_wall_s": round(b["wall_s"], 2),
                             "ckpt_mb": round(b["ckpt_mb"], 1), "step_files_left": b["step_files"],
                             # measured inside the long run (its last round): the periodic saves' own cost
                             "periodic_saves": b["in_run"].get("periodic_saves"),
                             "save_held_s": b["in_run"].get("held_s"), "save_written_s": b["in_run"].get("written_s"),
                             "in_run_share": b["in_run"].get("share")})
                print(rows[-1], flush=True)
            rec = recompute_cost(D, args.hidden_dim or 128)
            for r in rows:
                if r["D"] == D:
                    r.update({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()})
            # each D's rows as soon as they are measured (a later D may fail or be stopped)
            if append:
                write_csv(csv_path, [r for r in rows if r["D"] == D], append=True, machine=machine)
            else:
                write_csv(csv_path, rows, machine=machine)
    stem = out / f"checkpoints_{machine}"
    cols = ["D", "setting", "step_ms", "ratio_to_none", "periodic_saves", "in_run_share", "ckpt_mb", "recompute_s",
            "recomputable_bytes"]
    table = rows
    if append:  # the table holds every series of the CSV, this run's rows among them
        with csv_path.open() as f:
            table = [r for r in csv.DictReader(f)]
        cols = ["series", *cols]
    stem.with_suffix(".md").write_text(f"Checkpoints' cost per training step ({machine})\n\n"
                                       + markdown_table(table, cols, right=cols[-7:]) + "\n")
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for setting in args.settings:
        pts = [(r["D"], r["step_ms"]) for r in rows if r["setting"] == setting and r["step_ms"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=setting)
    ax.set_xscale("log")
    ax.set_xlabel("D")
    ax.set_ylabel("ms per training step")
    ax.set_title(f"lst-train with checkpoints, {machine}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    wrote(csv_path, stem.with_suffix(".md"), save_figure(fig, stem.with_suffix(".png")))


if __name__ == "__main__":
    main()
