"""``lst-compare <sweep or run directories>``: a comparison report of ``lst-train`` runs.

Every directory holding a ``results.json`` (searched recursively) is a run; its
``config.yaml`` and ``csv/metrics.csv`` give the swept values and the learning curves.
A W&B offline run (``wandb/offline-run-*``) whose directory holds no results.json is a
run too, read with W&B's own reader (results from its summary, values from its config,
curves from its history), and so are the curves of a run logged without the CSV log.
Writes, into ``--out``:

- ``runs.csv`` and ``runs.md``: one row per run (test top-k errors, MRR, perplexity,
  SimLex-999, the best validation top-k errors, step time), sorted by ``--metric``;
- ``heatmap.png``: ``--metric`` over two config keys (default the Z-loss's a and b): cells
  for a grid, points coloured by the metric (the best ringed) for a search such as Optuna;
- ``curves_steps.png`` and ``curves_time.png``: learning curves against steps and
  against wall-clock seconds of training; of a sweep (more than ``--best`` runs) the best
  few in colour over the others in grey, legends in numeric order (b=2 before b=10);
- ``curves_facets.png`` (sweeps): one panel per value of ``--x`` (else of ``--y``, else
  per run), a line per run inside it;
- ``report.html``: all of it in one self-contained page (images inlined as base64).
"""
from __future__ import annotations

import base64
import csv
import html
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import OneLineParser
from .run_files import read_config, read_results
from .run_keys import is_number, results_of
from .wandb_files import by_run_dir, find_run_files, read_parts

DEFAULT_METRIC = "test/top5_error"
DEFAULT_X, DEFAULT_Y = "loss.kwargs.a", "loss.kwargs.b"
SUMMARY_KEYS = ("mrr", "perplexity", "simlex_rho")
DEFAULT_BEST = 5  # a sweep's curves: the best few in colour
STEP_KEY = "trainer/global_step"  # the training step in W&B's history (its own _step counts log calls)


@dataclass
class Run:
    path: Path
    results: dict
    config: dict
    curves: dict[str, list[tuple[float, float, float | None]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.results.get("name") or self.path.name)

    def metric(self, key: str) -> float | None:
        """``test/top5_error``, ``val/mrr``, ``best_val/top5_error``, ``step_time_ms`` or a
        config key such as ``loss.kwargs.a``."""
        split, _, m = key.partition("/")
        if m and split == "best_val":  # the best: the least error or loss, the highest MRR
            pts = self.curves.get(f"val/{m}", [])
            return (min if lower_is_better(m) else max)(v for _, v, _ in pts) if pts else None
        if m and isinstance(self.results.get(split), dict):
            v = self.results[split].get(m)
        elif key in self.results and not isinstance(self.results[key], dict):
            v = self.results[key]
        else:
            v = config_value(self.config, key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def natural_key(text: str) -> tuple:
    """Sorts names with numbers by their values: ``b=2`` before ``b=10``, ``a=0.05`` before ``a=0.5``."""
    parts = re.split(r"(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", text)
    return tuple((0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts) if p)


def config_value(config: dict, key: str):
    if key in config:  # a flat config (W&B's): {"loss.kwargs.a": 0.1}
        return config[key]
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def read_curves(path: Path) -> dict[str, list[tuple[float, float, float | None]]]:
    """metrics.csv -> {column: [(step, value, elapsed_s or None)]}."""
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        return curves_of(csv.DictReader(f), "step")


def curves_of(rows, step_key: str) -> dict[str, list[tuple[float, float, float | None]]]:
    """Logged rows (the CSV's, or W&B's history) -> {key: [(step, value, elapsed_s or None)]}.
    Lightning writes one row per logging call with the other keys empty; a row without
    a time takes the training time logged last before it."""
    curves: dict[str, list] = {}
    t = None
    for row in rows:
        if row.get(step_key) in (None, ""):
            continue
        step = float(row[step_key])
        t = float(row["train/elapsed_s"]) if row.get("train/elapsed_s") not in (None, "") else t
        for k, v in row.items():
            if k in (step_key, "epoch", "train/elapsed_s") or k.startswith("_") or v in (None, ""):
                continue
            if isinstance(v, str) or is_number(v):
                curves.setdefault(k, []).append((step, float(v), t))
    return curves


def load_runs(paths: list[str | Path]) -> list[Run]:
    """The runs under ``paths``: each ``results.json`` (with the CSV log's curves, or W&B's
    history where there is no CSV log), then each W&B offline run without a results.json,
    read with W&B's own reader (app/wandb_files.py); a run resumed from its checkpoints, whose
    W&B parts (one a resume) share its directory, is one run."""
    runs = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such run or sweep directory: {p}")
        found = [p / "results.json"] if (p / "results.json").is_file() else sorted(p.rglob("results.json"))
        for res in found:
            d = res.parent
            cfg_path = d / "config.yaml"
            config = read_config(cfg_path) if cfg_path.is_file() else {}
            curves = read_curves(d / "csv" / "metrics.csv")
            logged = [] if curves else find_run_files(d / "wandb")
            if logged:  # no CSV log (logger.csv=false): W&B's history, of every part a resume began
                curves = curves_of(read_parts(logged, STEP_KEY).history, STEP_KEY)
            runs.append(Run(d, read_results(res), config, curves))
        done = {r.path.resolve() for r in runs}
        for run_dir, files in by_run_dir(find_run_files(p)).items():
            if run_dir not in done:  # a run's parts (one a resume) as one run
                wb = read_parts(files, STEP_KEY)
                results = {"name": wb.name, **results_of(wb.summary, wb.config)}
                runs.append(Run(wb.run_dir, results, wb.config, curves_of(wb.history, STEP_KEY)))
    if not runs:
        raise ValueError(f"no results.json and no W&B offline run under {[str(p) for p in paths]}: "
                         "are these lst-train run directories?")
    return runs


def without_results(paths: list[str | Path], runs: list[Run]) -> list[Path]:
    """The Hydra job directories (a ``.hydra`` folder) under ``paths`` that are none of ``runs``:
    jobs that failed, were refused, or are still running."""
    done = {r.path.resolve() for r in runs}
    return [h.parent for p in map(Path, paths) for h in sorted(p.rglob(".hydra")) if h.parent.resolve() not in done]


def table(runs: list[Run], metric: str) -> tuple[list[str], list[list]]:
    """Columns present in at least one run; rows best first by ``metric`` (missing last)."""
    tests, vals = (list(dict.fromkeys(k for r in runs for k in r.results.get(split, {}))) for split in ("test", "val"))
    topk, val_topk = ([k for k in keys if k.startswith("top") and k.endswith("_error")] for keys in (tests, vals))
    swept = [k for k in (DEFAULT_X, DEFAULT_Y) if any(r.metric(k) is not None for r in runs)]
    cols = (["run", "head", "loss", *swept, "steps"]
            + [f"test/{k}" for k in topk + [k for k in SUMMARY_KEYS if k in tests]]
            + [f"best_val/{k}" for k in val_topk]  # a run without the test split (test=false) has them too
            + ["step_time_ms", "wall_s", "dir"])
    if metric not in cols:
        cols.insert(len(swept) + 4, metric)
    def row(r: Run) -> list:
        fixed = {"run": r.name, "head": r.results.get("head", ""), "loss": r.results.get("loss") or "",
                 "steps": r.results.get("train_steps"), "dir": str(r.path)}
        return [fixed[c] if c in fixed else r.metric(c) for c in cols]

    return cols, [row(r) for r in ranked(runs, metric)]


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_tables(cols, rows, out: Path) -> str:
    with (out / "runs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows([["" if v is None else v for v in r] for r in rows])
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(fmt(v).replace("|", "\\|") for v in r) + " |" for r in rows]
    text = "\n".join(md) + "\n"
    (out / "runs.md").write_text(text)
    return text


def lower_is_better(metric: str) -> bool:
    return any(w in metric for w in ("error", "loss", "perplexity", "time", "wall"))


def heatmap(runs: list[Run], metric: str, x: str, y: str, out: Path) -> Path | None:
    """Mean of ``metric`` per (x, y) cell; None when fewer than two values on an axis.

    A grid (at least half its cells measured) is drawn as cells; a search (Optuna, random:
    every run at its own x and y) as points coloured by the metric, the best one ringed."""
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    cells: dict[tuple, list[float]] = {}
    for r in runs:
        vx, vy, v = r.metric(x), r.metric(y), r.metric(metric)
        if None not in (vx, vy, v) and math.isfinite(v):
            cells.setdefault((vx, vy), []).append(v)
    xs, ys = sorted({k[0] for k in cells}), sorted({k[1] for k in cells})
    if len(xs) < 2 or len(ys) < 2:
        return None
    means = {k: sum(vs) / len(vs) for k, vs in cells.items()}
    cmap = "viridis_r" if lower_is_better(metric) else "viridis"
    if is_grid(len(cells), len(xs), len(ys)):
        fig = grid_map(plt, np, means, xs, ys, cmap)
    else:
        fig = search_map(plt, means, xs, ys, cmap, lower_is_better(metric))
    ax = fig.axes[0]
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(metric)
    fig.tight_layout()
    path = out / "heatmap.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def is_grid(n_cells: int, n_x: int, n_y: int) -> bool:
    """A sweep over a grid measures at least half of its cells; a search, one per run."""
    return 2 * n_cells >= n_x * n_y


def grid_map(plt, np, means: dict, xs: list, ys: list, cmap: str):
    grid = np.full((len(ys), len(xs)), np.nan)
    for (vx, vy), v in means.items():
        grid[ys.index(vy), xs.index(vx)] = v
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.5, 0.8 * len(ys) + 2))
    im = ax.imshow(grid, origin="lower", cmap=cmap, aspect="auto")
    for i in range(len(ys)):
        for j in range(len(xs)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=8,
                        bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0})
    ax.set_xticks(range(len(xs)), [fmt(v) for v in xs])
    ax.set_yticks(range(len(ys)), [fmt(v) for v in ys])
    fig.colorbar(im, ax=ax)
    return fig


def search_map(plt, means: dict, xs: list, ys: list, cmap: str, lower: bool):
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    (px, py), pv = zip(*means), list(means.values())
    im = ax.scatter(px, py, c=pv, cmap=cmap, s=70, edgecolors="black", linewidths=0.5)
    for vx, vy, v in zip(px, py, pv):
        ax.annotate(f"{v:.3g}", (vx, vy), textcoords="offset points", xytext=(6, 5), fontsize=7)
    best = (min if lower else max)(means, key=means.get)
    ax.scatter(*best, s=260, facecolors="none", edgecolors="red", linewidths=1.5, label="best")
    ax.legend(loc="best", fontsize=8)
    for values, set_scale in ((xs, ax.set_xscale), (ys, ax.set_yscale)):
        if isinstance(values[0], (int, float)) and values[0] > 0 and values[-1] / values[0] > 20:
            set_scale("log")
    fig.colorbar(im, ax=ax)
    return fig


def ranked(runs: list[Run], metric: str) -> list[Run]:
    """Best first by ``metric`` (lower is better for errors, losses and perplexity); runs
    without it last."""
    lower = lower_is_better(metric)

    def key(r: Run):
        v = r.metric(metric)
        ok = v is not None and math.isfinite(v)
        return (not ok, (v if lower else -v) if ok else 0.0, natural_key(r.name))
    return sorted(runs, key=key)


def highlighted(runs: list[Run], metric: str, best: int) -> tuple[list[Run], list[Run]]:
    """(the runs drawn in colour, in numeric name order; the rest, drawn in grey): all of
    them when there are at most ``best``."""
    if len(runs) <= best:
        return sorted(runs, key=lambda r: natural_key(r.name)), []
    order = ranked(runs, metric)
    return sorted(order[:best], key=lambda r: natural_key(r.name)), order[best:]


def points(r: Run, key: str, against: str) -> list[tuple[float, float]]:
    pts = r.curves.get(key, [])
    return [(t, v) for _, v, t in pts if t is not None] if against == "time" else [(s, v) for s, v, _ in pts]


def curves(runs: list[Run], keys: list[str], against: str, out: Path, metric: str = DEFAULT_METRIC,
           best: int = DEFAULT_BEST) -> Path | None:
    """One panel per curve key; x is the step or the training wall-clock seconds. More than
    ``best`` runs: the best by ``metric`` in colour, the others thin and grey behind them."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    keys = [k for k in keys if any(len(r.curves.get(k, [])) for r in runs)]
    if not keys:
        return None
    shown, rest = highlighted(runs, metric, best)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4), squeeze=False)
    drawn = False
    cmap = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20" if len(shown) <= 20 else "turbo")
    colors = [cmap(i if len(shown) <= 20 else i / max(len(shown) - 1, 1)) for i in range(len(shown))]
    for ax, k in zip(axes[0], keys):
        for r in rest:
            pts = points(r, k, against)
            if pts:
                ax.plot(*zip(*pts), color="0.8", linewidth=0.7, zorder=1)
        for r, color in zip(shown, colors):
            pts = points(r, k, against)
            if pts:
                drawn = True
                ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, color=color, label=r.name, zorder=2)
        ax.set_xlabel("training seconds (wall clock)" if against == "time" else "step")
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    if rest:
        fig.suptitle(f"the best {len(shown)} of {len(runs)} runs by {metric} (the others in grey)")
    # one legend beside the panels: with a sweep's many runs it would hide the curves
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    path = out / f"curves_{'time' if against == 'time' else 'steps'}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def facet_groups(runs: list[Run], x: str, y: str) -> tuple[str, list[tuple[str, list[tuple[str, Run]]]]]:
    """How a sweep's curves are split into panels: by the values of ``x`` (a line per
    value of ``y`` inside, or per run), else of ``y``, else one panel per run; values and
    labels in numeric order. Returns (what a panel is, [(panel title, [(label, run)])])."""
    def values(key):
        return sorted({r.metric(key) for r in runs if r.metric(key) is not None})

    for outer, inner in ((x, y), (y, None)):
        if len(values(outer)) >= 2:
            panels = []
            by_inner = inner is not None and len(values(inner)) >= 2
            for v in values(outer):
                members = [r for r in runs if r.metric(outer) == v]
                lines = [(f"{inner}={fmt(r.metric(inner))}" if by_inner else r.name, r) for r in members]
                panels.append((f"{outer}={fmt(v)}", sorted(lines, key=lambda lr: natural_key(lr[0]))))
            return outer, panels
    return "run", [(r.name, [(r.name, r)]) for r in sorted(runs, key=lambda r: natural_key(r.name))]


def facets(runs: list[Run], key: str, x: str, y: str, out: Path) -> Path | None:
    """``key`` against steps, one small panel per group of ``facet_groups`` (same y axis)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    if not any(r.curves.get(key) for r in runs):
        return None
    by, panels = facet_groups(runs, x, y)
    ncols = min(len(panels), 5)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.8 * nrows), squeeze=False, sharex=True,
                             sharey=True)
    for ax, (title, lines) in zip(axes.flat, panels):
        cmap = plt.get_cmap("viridis")
        for i, (label, r) in enumerate(lines):
            pts = points(r, key, "steps")
            if pts:
                ax.plot(*zip(*pts), color=cmap(i / max(len(lines) - 1, 1)), label=label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if 1 < len(lines) <= 8:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.supxlabel("step")
    fig.supylabel(key)
    fig.suptitle(f"{key}, one panel per {by}")
    fig.tight_layout()
    path = out / "curves_facets.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_html(cols, rows, images: list[Path], title: str, out: Path) -> Path:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
    imgs = "".join(
        f'<h2>{html.escape(p.stem)}</h2><img alt="{html.escape(p.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">' for p in images)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif}table{border-collapse:collapse;font-size:12px}"
            "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}img{max-width:100%}</style>"
            f"</head><body><h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table>{imgs}</body></html>")
    path = out / "report.html"
    path.write_text(page)
    return path


def compare(paths: list[str | Path], out: str | Path, metric: str = DEFAULT_METRIC,
            x: str = DEFAULT_X, y: str = DEFAULT_Y, curve_keys: list[str] | None = None,
            best: int = DEFAULT_BEST) -> dict:
    """Writes the report; returns ``{"runs": n, "files": {name: path}, "without_results": [job
    directories with no results]}``."""
    if best < 1:
        raise ValueError(f"--best must be at least 1, not {best}")
    out = Path(out)
    there = next(p for p in (out, *out.parents) if p.exists())  # the report's directory, or where it goes
    if not there.is_dir():
        raise ValueError(f"--out {out}: {there} is a file, not a directory")
    runs = load_runs(paths)
    if all(r.metric(metric) is None for r in runs):
        have = sorted({f"{s}/{k}" for r in runs for s in ("val", "test") for k in r.results.get(s, {})})
        raise ValueError(f"--metric {metric!r} is in none of the runs; available: {have}")
    for flag, key, default in (("--x", x, DEFAULT_X), ("--y", y, DEFAULT_Y)):
        if key != default and all(r.metric(key) is None for r in runs):  # asked for by name: a typo, or not a number
            raise ValueError(f"{flag} {key!r}: no run has a number under that key (a config key such as head.lr, "
                             "loss.kwargs.b, or a key of results.json)")
    if curve_keys is None:
        split, _, m = metric.partition("/")
        curve_keys = ["train/loss"] + ([f"val/{m}"] if m and split in ("test", "val", "best_val") else [])
    else:  # asked for by name: a column no run logged is a typo, not an empty panel
        missing = [k for k in curve_keys if not any(r.curves.get(k) for r in runs)]
        if missing:
            have = sorted({k for r in runs for k, pts in r.curves.items() if pts})
            raise ValueError(f"--curve {', '.join(map(repr, missing))}: logged by none of the runs; available: {have}")
    out.mkdir(parents=True, exist_ok=True)
    cols, rows = table(runs, metric)
    write_tables(cols, rows, out)
    images = [p for p in (heatmap(runs, metric, x, y, out),
                          curves(runs, curve_keys, "steps", out, metric, best),
                          curves(runs, curve_keys, "time", out, metric, best),
                          facets(runs, curve_keys[-1], x, y, out) if len(runs) > best else None) if p]
    report = write_html(cols, rows, images, f"lst-compare: {len(runs)} runs, sorted by {metric}", out)
    files = {p.name: p for p in [out / "runs.csv", out / "runs.md", *images, report]}
    return {"runs": len(runs), "files": files, "without_results": without_results(paths, runs)}


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(prog="lst-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="run directories or sweep directories (searched recursively)")
    ap.add_argument("-o", "--out", default="compare_report", help="output directory (default: %(default)s)")
    ap.add_argument("--metric", default=DEFAULT_METRIC,
                    help="sort key and heatmap value: test/<m>, val/<m>, best_val/<m> (default: %(default)s)")
    ap.add_argument("--x", default=DEFAULT_X, help="heatmap x: a config key (default: %(default)s)")
    ap.add_argument("--y", default=DEFAULT_Y, help="heatmap y: a config key (default: %(default)s)")
    ap.add_argument("--curve", action="append", dest="curves",
                    help="a metrics.csv column to plot (repeatable; default: train/loss and val/<metric>)")
    ap.add_argument("--best", type=int, default=DEFAULT_BEST,
                    help="a sweep's curves: the best N runs in colour, and a faceted view (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        res = compare(args.dirs, args.out, args.metric, args.x, args.y, args.curves, args.best)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    if res["without_results"]:
        print(f"lst-compare: no results in {len(res['without_results'])} job directories (failed, refused or still "
              f"running), not in the report: {', '.join(map(str, res['without_results']))}", file=sys.stderr)
    print(f"{res['runs']} runs -> {Path(args.out) / 'report.html'}")
    print((Path(args.out) / "runs.md").read_text())


if __name__ == "__main__":
    main()
