"""What every benchmark script in scripts/ shares: where results go, the machine's name,
clocks and interleaved timing, the Zipf targets, CSV, markdown and plot output.

Scripts run as ``python scripts/<name>.py``, so this folder is on ``sys.path``; import
this module before ``lst_lightning``: from a bare checkout (a GPU machine without the
project's environment) it puts ``src/`` and ``triton_kernels/`` on the path.

Output policy: a script writes into a fresh run directory,
``outputs/bench/<script>/<YYYY-MM-DD_HH-MM-SS>/`` under the current directory (as
``lst-train`` does), or into ``--out DIR``; only ``--update-results`` writes into the
committed ``benchmarks/results/`` (``$LST_RESULTS_DIR`` stands in for it in tests).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("lst_lightning") is None:  # a bare checkout, not installed
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "triton_kernels")]

import torch  # noqa: E402

from lst_lightning.app.machine import machine_name  # noqa: E402,F401  (the scripts' machine name)
from lst_lightning.data.synthetic import zipf_ranks  # noqa: E402

RESULTS_ENV = "LST_RESULTS_DIR"

Step = Callable[[], None]


# --- arguments --------------------------------------------------------------------------

def positive_int(text: str) -> int:
    """An argparse ``type``: a count or size of at least 1 (a bad one is argparse's one-line error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def existing_path(text: str) -> Path:
    """An argparse ``type``: a file or folder that is there (else argparse's one-line error, exit 2)."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or folder: {text}")
    return path


# --- where results go -------------------------------------------------------------------

def results_dir() -> Path:
    """The committed results folder (``$LST_RESULTS_DIR`` when set: tests point it at a copy)."""
    return Path(os.environ.get(RESULTS_ENV) or ROOT / "benchmarks" / "results")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None,
                       help="folder for the results (default: a fresh outputs/bench/<script>/<time>/ "
                            "under the current directory)")
    where.add_argument("--update-results", action="store_true",
                       help="write into the committed benchmarks/results/ (replacing this machine's files)")


def output_dir(args: argparse.Namespace, script: str) -> Path:
    """The folder this run writes into (made now): ``--out``, the committed results with
    ``--update-results``, else a fresh run directory, never one that an earlier run wrote."""
    if args.update_results:
        folder = results_dir()
    elif args.out is not None:
        folder = args.out
    else:
        base = Path("outputs") / "bench" / script / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        folder, n = base, 0
        while True:  # two runs in the same second get two folders
            try:
                folder.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                folder = base.with_name(f"{base.name}_{n}")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"results go to {folder}", flush=True)
    return folder


# --- the machine and its clocks ---------------------------------------------------------

def perf_clock(fn: Step) -> float:
    """Seconds one call of ``fn`` takes on the host's clock."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cuda_clock(fn: Step) -> float:
    """Seconds one call of ``fn`` takes on the GPU, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device | str) -> Callable[[Step], float]:
    return cuda_clock if torch.device(device).type == "cuda" else perf_clock


def interleaved_times(steps: dict[str, tuple[Step, int]], rounds: int, warmup: int = 2,
                      clock: Callable[[Step], float] = perf_clock) -> dict[str, list[float]]:
    """Seconds per step of each function, every timing kept, timed in alternation.

    Each round runs every function ``inner`` times in turn, so a load that comes and
    goes on the machine falls on all of them alike and the ratios stay fair.
    ``clock(fn)`` times one call (the host's clock by default; CUDA events on a GPU)."""
    for fn, inner in steps.values():
        for _ in range(min(warmup, inner)):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, (fn, inner) in steps.items():
            for _ in range(inner):
                times[name].append(clock(fn))
    return times


def interleaved_medians(steps: dict[str, tuple[Step, int]], rounds: int, warmup: int = 2,
                        clock: Callable[[Step], float] = perf_clock) -> dict[str, float]:
    """Median seconds per step of each function, timed in alternation (``interleaved_times``)."""
    return {k: statistics.median(v) for k, v in interleaved_times(steps, rounds, warmup, clock).items()}


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of ``xs``, linear between order statistics (numpy's default)."""
    import numpy as np  # noqa: PLC0415

    return float(np.quantile(xs, q))


# --- inputs -----------------------------------------------------------------------------

def zipf_targets(shape: int | tuple[int, ...], num_classes: int, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Class ids under the synthetic task's Zipf law (id 0 most frequent): frequent
    classes repeat across the batch, as in text."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    return zipf_ranks(u, num_classes).to(device)


# --- outputs ----------------------------------------------------------------------------

def write_csv(path: Path, rows: list[dict], columns: Iterable[str] | None = None, *, append: bool = False,
              machine: str | None = None) -> Path:
    """Rows as CSV, a ``machine`` column first (this machine unless the rows name one) and where
    ``columns`` do not place them, the ``torch`` version, the checkout's ``commit`` and the ``date``
    last (``provenance``; the rows' own where they have them); ``append`` adds to an existing file
    (its header is kept); keys not in ``columns`` are left out."""
    where = {"machine": machine or machine_name(), **measured_with()}
    rows = [{**where, **r} for r in rows]
    fresh = not (append and path.exists())
    if fresh:
        columns = list(dict.fromkeys(["machine", *(columns or rows[0]), *where]))
    else:
        with path.open(newline="") as fh:
            columns = next(csv.reader(fh))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w" if fresh else "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        if fresh:
            w.writeheader()
        w.writerows(rows)
    return path


def markdown_table(rows: list[dict], columns: list[str], right: Iterable[str] = ()) -> str:
    """A GitHub markdown table; floats to 4 significant digits, None empty; ``right``: right-aligned columns."""
    right = set(right)

    def cell(v) -> str:
        return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "".join("---:|" if c in right else "---|" for c in columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on benchmark machines)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def save_rows(args: argparse.Namespace, out: Path, name: str, rows: list[dict], columns: list[str],
              argv: list[str] | None) -> None:
    """A run's rows: ``<name>.csv`` in ``out``; with ``--update-results`` appended instead to the
    tidy ``<name>.csv`` of the results folder (``out``: the committed ``benchmarks/results/``, or
    ``$LST_RESULTS_DIR``) by ``scripts/results_pages.py``'s ``add``, which records the commit, date,
    torch version and the command (the script and ``argv``). Nothing but that CSV is written there."""
    if not args.update_results:
        wrote(write_csv(out / f"{name}.csv", rows, columns))
        return
    import results_pages  # noqa: PLC0415  (beside this file)

    script = Path(sys.argv[0]).name if argv is None else f"{name}.py"
    command = f"python3 scripts/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix=f"{name}_") as tmp:
        n = results_pages.add_rows(name, write_csv(Path(tmp) / f"{name}.csv", rows, columns), command, data=out)
    print(f"added {n} rows to {out / f'{name}.csv'}; now run scripts/results_pages.py", flush=True)


def provenance() -> dict:
    """Where a row was measured: the machine, torch, this checkout's commit and today's date."""
    return {"machine": machine_name(), **measured_with()}


def measured_with() -> dict:
    """The torch version, this checkout's commit and today's date (``provenance`` without the machine)."""
    from results_pages import commit_of_checkout  # noqa: PLC0415  (beside this file)

    return {"torch": torch.__version__, "commit": commit_of_checkout(), "date": datetime.date.today().isoformat()}


def wrote(*paths: Path) -> None:
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
