"""Where the factored head pays, by its arithmetic: for each width d, lst-train's
default factored step counted (``count_step.py``: the FLOPs of its matrix products) against the
full softmax's and the sampled softmax's, and the number of classes D at which the full softmax
costs as much.

    uv run python scripts/crossover.py [--d 512,1024,2048,4096] [--m 1024] [--S 1024]
        [--counted benchmarks/results/crossover.csv] [--measured DIR_OR_CSV] [--smoke] [--out DIR | --update-results]

The factored step is U units of 2 m w^2 FLOPs (w = d + 1: the app's bias), counted on the
GPU's step (device flags, U^-1 by products) with ``loss=sampled`` at D = 10^5, whose S = 512
sampled slots are those of every D from 10^5 to 10^7 (the count does not otherwise depend on D).
A full softmax, fused or not, makes three products of m x d x D a step (the logits, dL/dH,
dL/dW): 6 m D d FLOPs, 3 D / d units of m d^2 work; the sampled softmax with S classes shared by
the batch about 6 m S d. So the full softmax costs as much as the factored step at
D* = 2 U m w^2 / (6 m d) classes, and the factored step as much as D* / S sampled softmax steps.

``--counted``: the counts of a CSV this script wrote (the committed benchmarks/results/crossover.csv),
not counted again (a count at d = 4096 takes minutes on a CPU). ``--measured``: a
``bench_heads.py --sweep-d`` CSV from a GPU (or the folder that holds one): for each d, the D
at which the faster of the fused softmaxes (``F.linear_cross_entropy``, cut-cross-entropy, bf16),
linear in D between its measured sizes, takes as long as the default factored step (its
fastest path).

Writes ``crossover_<machine>.csv`` (a row per d and m, the machine the measured crossover ran on
where there is one; ``results_pages.py add crossover`` takes it) and ``.md`` into a fresh run
directory or ``--out DIR``; with ``--update-results`` appends the rows to the committed tidy
``benchmarks/results/crossover.csv`` instead.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import add_output_args, machine_name, markdown_table, output_dir, save_rows, write_csv, wrote

import torch

from bench_heads import parse_ints
from count_step import count
from lst_lightning.heads.samplers import sampled_softmax_num_samples, slots_num_samples

COUNT_D = 100_000  # its sampled slots (512) are those of every D up to 10^7
WIDTHS = [512, 1024, 2048, 4096]
COLUMNS = ["d", "m", "D_counted", "slots", "units", "gflop", "products", "operators", "crossover_D", "S",
           "vs_sampled", "measured_D", "measured_on"]


def crossover_row(d: int, m: int, D: int, S: int) -> dict:
    """The default step at width d and m rows counted, and what it is worth in softmax classes."""
    c = count(D, d, m, loss="sampled")
    flops = sum(c.flops.values())
    units = flops / (2 * m * c.width ** 2)
    crossover = flops / (6 * m * d)  # the D (and the S) whose softmax costs these FLOPs
    return dict(d=d, m=m, D_counted=D, slots=slots_num_samples(D), units=round(units, 2),
                gflop=round(flops / 1e9, 3), products=sum(c.gemms.values()), operators=sum(c.ops.values()),
                crossover_D=round(crossover), S=S, vs_sampled=round(crossover / S, 2), measured_D="", measured_on="")


def counted_rows(path: Path) -> dict[tuple[int, int], dict]:
    """(d, m) -> the counted columns of a CSV this script wrote (the newest row of each)."""
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    keep = COLUMNS[:COLUMNS.index("measured_D")]
    return {(int(r["d"]), int(r["m"])): {k: r[k] for k in keep} for r in rows}


def sweep_csv(path: Path) -> Path:
    """A ``bench_heads.py --sweep-d`` CSV: ``path``, or the one (not a smoke run's, unless only) in folder ``path``."""
    if path.is_file():
        return path
    found = sorted(path.glob("bench_heads_dsweep_*.csv")) or sorted(path.glob("bench_heads_smoke_dsweep_*.csv"))
    if not found:
        raise FileNotFoundError(f"--measured {path}: no bench_heads_dsweep_*.csv there (bench_heads.py --sweep-d)")
    return found[0]


def measured_crossovers(path: Path) -> dict[tuple[int, int], tuple[int, str]]:
    """(d, m) -> (the D where the faster fused softmax's measured step meets the factored default's,
    the machine), from a ``bench_heads.py --sweep-d`` CSV (its GPU rows)."""
    with sweep_csv(path).open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["device"] == "cuda" and r["median_ms"] not in ("", None)
                and r["status"].split(":")[0] in ("ok", "slow")]
    out = {}
    for d, m in sorted({(int(r["d"]), int(r["m"])) for r in rows}):
        here = [r for r in rows if (int(r["d"]), int(r["m"])) == (d, m)]
        ours = [float(r["median_ms"]) for r in here if r["head"].startswith("factored") and r["variant"] == "sampled"]
        soft: dict[int, float] = {}
        for r in here:
            if r["head"] == "softmax" and r["variant"] in ("torch", "liger", "cce"):
                D = int(r["D"])
                soft[D] = min(soft.get(D, float("inf")), float(r["median_ms"]))
        if not ours or not soft:
            continue
        t = statistics.median(ours)  # flat in D: its median over the sizes
        (D0, t0), *rest = sorted(soft.items())
        if rest:
            D1, t1 = rest[-1]
            slope = (t1 - t0) / (D1 - D0)
            D_star = D0 + (t - t0) / slope if slope > 0 else float("inf")
        else:  # one size: proportional in D
            D_star = D0 * t / t0
        out[(d, m)] = (max(0, round(D_star)), here[0]["machine"])
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["# Where the factored head pays, by its arithmetic", "",
             "lst-train's default factored step (`loss=sampled`) counted by `scripts/count_step.py`, in units of "
             "2 m w^2 FLOPs (w = d + 1), against a full softmax's 6 m D d and a sampled softmax's 6 m S d.", "",
             markdown_table(rows, COLUMNS, right=[c for c in COLUMNS if c != "measured_on"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=parse_ints, default=None, help=f"widths (default {WIDTHS})")
    p.add_argument("--m", type=parse_ints, default=None, help="rows a step (default 1024)")
    p.add_argument("--S", type=int, default=sampled_softmax_num_samples(1_000_000),
                   help="the sampled softmax's S (default: its S at 10^6 classes)")
    p.add_argument("--counted", type=Path, default=None, metavar="CSV",
                   help="take the counts from a CSV this script wrote instead of counting (its widths and m)")
    p.add_argument("--measured", type=Path, default=None, metavar="CSV_OR_DIR",
                   help="a bench_heads.py --sweep-d CSV from a GPU (or its folder): the measured crossover beside "
                        "the counted one")
    p.add_argument("--smoke", action="store_true", help="tiny widths, seconds (tests)")
    add_output_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ds = args.d or ([8, 16] if args.smoke else WIDTHS)
    ms = args.m or ([16] if args.smoke else [1024])
    D = 300 if args.smoke else COUNT_D
    measured = measured_crossovers(args.measured) if args.measured else {}
    counted = counted_rows(args.counted) if args.counted else None
    if counted is not None and not (args.d or args.m):
        ds, ms = sorted({d for d, _ in counted}), sorted({m for _, m in counted})
    rows = []
    for d in ds:
        for m in ms:
            if counted is not None and (d, m) not in counted:
                continue
            row = ({**counted[(d, m)], "measured_D": "", "measured_on": ""} if counted is not None
                   else crossover_row(d, m, D, args.S))
            if (d, m) in measured:
                row["measured_D"], row["measured_on"] = measured[(d, m)]
            rows.append(row)
            print(f"d={d:5d} m={m:5d}: {float(row['units']):7.2f} units, {float(row['gflop']):9.3f} GFLOP; a full "
                  f"softmax as costly at D = {int(row['crossover_D']):,}; {float(row['vs_sampled']):.3g} sampled "
                  f"softmax steps at S = {row['S']}"
                  + (f"; measured on {row['measured_on']}: D = {row['measured_D']:,}" if row["measured_D"] != "" else ""),
                  flush=True)
    if args.update_results:  # appended to the committed tidy CSV, with the commit, date and torch of the run
        save_rows(args, output_dir(args, "crossover"), "crossover", rows, COLUMNS, argv)
        return 0
    machine = next((r["measured_on"] for r in rows if r["measured_on"]), machine_name())
    stem = output_dir(args, "crossover") / f"crossover_{machine}"
    path = write_csv(stem.with_suffix(".csv"), rows, COLUMNS, machine=machine)
    stem.with_suffix(".md").write_text(markdown(rows))
    print("counts: machine-free" + (f"; measured on {machine}" if measured else ""))
    wrote(path, stem.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
