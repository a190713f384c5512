"""The results pages, made from the measurements: ``docs/results/<benchmark>.md`` (tables and
plots), the index ``docs/results/README.md`` and the README's key figures, all generated
from the tidy CSVs in ``benchmarks/results/`` (one per benchmark; numeric columns, and the
machine, torch version, commit, date and command of every row).

    uv run python scripts/results_pages.py            # write every page, plot and the README's figures
    uv run python scripts/results_pages.py --check    # list what differs from what this script makes
    uv run python scripts/results_pages.py add BENCHMARK RAW.csv --command "..."   # add a run's rows

``add`` appends the rows of a benchmark script's own CSV (``--out DIR``) to the benchmark's
tidy CSV, with this checkout's commit, today's date, the torch version and the command. Pages
are never edited by hand: tests/scripts/test_results_pages.py fails when a committed page, plot
or the README's figures differ from what this script makes of the committed CSVs.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import math
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpu_targets import MAX_MS, TARGET, verdict

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "results"
PAGES = ROOT / "docs" / "results"
README = ROOT / "README.md"
#: the columns every row of a tidy CSV ends with
META = ("machine", "torch", "commit", "date", "command")
#: text columns (every other column of a tidy CSV is numeric, or empty where not measured)
TEXT = {*META, "head", "variant", "dtype", "device", "status", "inverse", "precision", "impl", "group", "run", "task",
        "mode", "clock", "body", "embedding", "optimizers", "setting", "route", "loss", "lo_scope", "kernel", "check",
        "what", "compiled", "measured_on", "gradient", "case", "rival", "unit", "note"}
KEY_START = "<!-- key figures: made by scripts/results_pages.py from benchmarks/results/; do not edit -->"
KEY_END = "<!-- end of key figures -->"
#: the README's "which head" table: its column REAL_COLUMN is made from the data, its other cells are edited there
WHICH_START = "<!-- which head: the real-corpus column made by scripts/results_pages.py; edit the others -->"
WHICH_END = "<!-- end of which head -->"
REAL_COLUMN = "real corpus, CPU"

Row = dict[str, object]


# --- reading the data -------------------------------------------------------------------

def load(name: str) -> list[Row]:
    """The rows of ``benchmarks/results/<name>.csv``: numbers as float (int where whole), None where empty."""
    rows = []
    with (DATA / f"{name}.csv").open(newline="") as fh:
        for raw in csv.DictReader(fh):
            rows.append({k: v if k in TEXT else number(v) for k, v in raw.items()})
    return rows


def number(text: str):
    if text == "":
        return None
    x = float(text)
    return int(x) if x.is_integer() and "." not in text and "e" not in text.lower() else x


def short_machine(name: str) -> str:
    return {"AMD-EPYC-2cores": "2-core AMD EPYC (CPU)", "AMD-EPYC-2cores-AVX2": "2-core AMD EPYC, AVX2 only (CPU)",
            "Intel-Xeon-2cores": "2-core Intel Xeon (CPU)",
            "NVIDIA-H100-80GB-HBM3": "NVIDIA H100", "NVIDIA-H200": "NVIDIA H200"}.get(name, name)


def short_torch(version: str) -> str:
    return version.split("+")[0]


# --- formatting -------------------------------------------------------------------------

def fmt(x, digits: int = 3) -> str:
    """A number for a table: about ``digits`` significant figures, thousands spaced, empty for None."""
    if x is None or isinstance(x, float) and math.isnan(x):
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return f"{x:,}".replace(",", " ")
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}".replace(",", " ")
    if abs(x) < 1e-3:
        return f"{x:.1e}"
    places = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{places}f}"


def big(D) -> str:
    """A class count as written in the docs: 10^6, 2 x 10^7, 793 471."""
    exp = math.floor(math.log10(D))
    lead = D / 10 ** exp
    if lead == 1:
        return f"10^{exp}"
    if lead.is_integer():
        return f"{int(lead)} x 10^{exp}"
    if (10 * lead).is_integer():
        return f"{lead:.1f} x 10^{exp}"
    return fmt(D)


def table(header: list[str], rows: Iterable[list], right_from: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < right_from else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return "\n".join(lines)


#: a run's flag that wrote its rows into benchmarks/results/: a page's command leaves it out,
#: so that running it again makes a run directory and leaves the committed data as it is
UPDATE_FLAG = "--update-results"


def page_command(row: Row) -> str:
    """The command that reproduces ``row``: its recorded command without ``--update-results``
    and without the run's output folder (``--out``: the script then makes a fresh one, benchlib's),
    and, where the row records its torch threads, with ``--threads`` at that count."""
    words, recorded = [], str(row["command"]).split()
    for i, w in enumerate(recorded):
        if w == UPDATE_FLAG or w.startswith("--out=") or w == "--out" or (i and recorded[i - 1] == "--out"):
            continue
        words.append(w)
    if "threads" in row and not any(w == "--threads" or w.startswith("--threads=") for w in words):
        words += ["--threads", str(row["threads"])]
    return " ".join(words)


def provenance(rows: list[Row]) -> str:
    """Which machine, torch, commit and date made the rows, and the command that reproduces
    them (``page_command``), with a count."""
    groups: dict[tuple, int] = defaultdict(int)
    for r in rows:
        groups[tuple(r[k] for k in META[:-1]) + (page_command(r),)] += 1
    body = [[short_machine(m), short_torch(t), f"`{c}`", d, f"`{cmd}`", str(n)]
            for (m, t, c, d, cmd), n in sorted(groups.items(), key=lambda kv: (kv[0][3], kv[0][0], kv[0][4], kv[0]))]
    return table(["machine", "torch", "commit", "date", "command", "rows"], body, right_from=5)


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def signed(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}"


def with_se(m_se: tuple[float, float]) -> str:
    """A mean difference and its standard error (none for one seed)."""
    m, se = m_se
    return signed(m) if math.isnan(se) else f"{signed(m)} ± {se:.3f}"


# --- plots (SVG, byte-for-byte reproducible with the matplotlib that made them) ------------

def pyplot():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.hashsalt": "lst-lightning", "svg.fonttype": "none", "font.size": 9,
                                "path.simplify": False})
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def made_with() -> str:
    """The plots' creator, as each SVG names it: this matplotlib (another lays a plot out
    differently: ``differing`` compares a plot byte for byte only with the one that made it)."""
    import matplotlib  # noqa: PLC0415

    return f"matplotlib {matplotlib.__version__}"


def svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": made_with()}, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def line_panels(panels: list[tuple[str, dict[str, list[tuple[float, float]]]]], xlabel: str, ylabel: str) -> str:
    """Log-log lines, one panel per (title, {label: [(x, y), ...]})."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        for label, pts in lines.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
        ax.set(xscale="log", yscale="log", title=title, xlabel=xlabel)
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return svg(fig)


# --- the pages ----------------------------------------------------------------------------

@dataclass
class Page:
    name: str          # benchmarks/results/<name>.csv -> docs/results/<name>.md
    title: str
    script: str        # what measures it
    about: str         # what a row is
    body: Callable[[list[Row]], tuple[str, dict[str, str]]]  # rows -> (markdown, {file: svg text})


def code(text: str) -> str:
    """``text`` as code, unless it marks its code itself."""
    return text if "`" in text else f"`{text}`"


def header(page: Page) -> str:
    return (f"# {page.title}\n\n{page.about}\n\nMeasured by {code(page.script)}. Data: "
            f"[benchmarks/results/{page.name}.csv](../../benchmarks/results/{page.name}.csv); this page is made by "
            "`scripts/results_pages.py` from it (edit the data or the script, never the page).\n")


# head_step: every head's step over D (bench_heads.py)

#: the heads drawn in the step plot, in its legend's order
STEP_LINES = [("factored/zloss", "factored, Z-loss (autograd)"), ("factored_graph/zloss", "factored, Z-loss (CUDA graph)"),
              ("factored/sampled", "factored, loss=sampled"), ("naive/zloss", "naive (explicit W)"),
              ("softmax/torch", "softmax, F.linear_cross_entropy"), ("logits_ce/torch", "softmax, logits + CE"),
              ("softmax/cce", "softmax, cut-cross-entropy"), ("softmax/liger", "softmax, Liger-Kernel"),
              ("hsoftmax/sqrt_mass", "hierarchical softmax"), ("hsoftmax/sqrt_mass,sparse", "hierarchical softmax"),
              ("adaptive/0.05,0.25", "adaptive softmax"), ("sampled/log_uniform", "sampled softmax"),
              ("sampled/log_uniform,sparse", "sampled softmax")]
FACTORED_PATHS = ("factored/zloss", "factored_sync/zloss", "factored_graph/zloss")


def main_size(rows: list[Row], machine: str) -> tuple[int, int]:
    """The (d, m) a machine's step table shows: the GPU targets' 512 x 1024, the CPU's 300 x 128."""
    return (512, 1024) if machine.startswith("NVIDIA") else (300, 128)


def ok_ms(rows: list[Row], machine: str, name: str, D: int, d: int, m: int, device: str | None = None):
    for r in rows:
        if (r["machine"], f"{r['head']}/{r['variant']}", r["D"], r["d"], r["m"]) == (machine, name, D, d, m) \
                and r["status"] == "ok" and (device is None or r["device"] == device):
            return r["median_ms"]
    return None


def fastest_factored(rows: list[Row], machine: str, D: int, d: int, m: int) -> tuple[float, str]:
    times = [(ok_ms(rows, machine, p, D, d, m, "cuda" if machine.startswith("NVIDIA") else None), p) for p in FACTORED_PATHS]
    return min((t, p) for t, p in times if t is not None)


def head_step_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    out, panels = [], []
    for machine in sorted({r["machine"] for r in rows}, key=lambda m: (m.startswith("NVIDIA"), m)):
        rs = [r for r in rows if r["machine"] == machine and r["device"] != "cpu" or
              r["machine"] == machine and machine.startswith("AMD")]
        sizes = sorted({(r["d"], r["m"]) for r in rs}, key=lambda s: (s != main_size(rows, machine), s))
        for d, m in sizes:
            cells = [r for r in rs if (r["d"], r["m"]) == (d, m)]
            Ds = sorted({r["D"] for r in cells})
            names = list(dict.fromkeys(f"{r['head']}/{r['variant']}" for r in cells))
            body = []
            for n in names:
                dtype = next(r["dtype"] for r in cells if f"{r['head']}/{r['variant']}" == n)
                times = [ok_ms(rows, machine, n, D, d, m) for D in Ds]
                if any(t is not None for t in times):
                    body.append([f"`{n}` ({dtype})", *[t if t is not None else "" for t in times]])
            out.append(f"\n\n## {short_machine(machine)}: d = {d}, m = {m}\n\nMedian ms a step (forward, backward and "
                       "update); an empty cell was not measured, and the row's `status` in the CSV says why.\n\n"
                       + table(["head", *[f"D = {big(D)}" for D in Ds]], body))
        d, m = main_size(rows, machine)
        lines: dict[str, list] = defaultdict(list)
        for name, label in STEP_LINES:
            for r in rs:
                if f"{r['head']}/{r['variant']}" == name and (r["d"], r["m"]) == (d, m) and r["status"] == "ok":
                    lines[label].append((r["D"], r["median_ms"]))
        panels.append((f"{short_machine(machine)}, d = {d}, m = {m}", {k: v for k, v in lines.items() if v}))
    gpu = "NVIDIA-H100-80GB-HBM3"
    D0, D1, Dp = 10_000, 20_000_000, 793_471
    t0, p0 = fastest_factored(rows, gpu, D0, 512, 1024)
    t1, p1 = fastest_factored(rows, gpu, D1, 512, 1024)
    tp, pp = fastest_factored(rows, gpu, Dp, 512, 1024)
    cce = ok_ms(rows, gpu, "softmax/cce", Dp, 512, 1024)
    naive_host = ok_ms(rows, gpu, "naive/zloss", Dp, 300, 128, "cpu")
    naive_gpu = ok_ms(rows, gpu, "naive/zloss", Dp, 300, 128, "cuda")
    tpp, ppp = fastest_factored(rows, gpu, Dp, 300, 128)
    summary = (
        "\n## What holds\n\n"
        f"- The factored step is flat in D: on the H100 at d = 512, m = 1024 it takes {fmt(t0)} ms at D = {big(D0)} "
        f"and {fmt(t1)} ms at D = {big(D1)} ({fmt(t1 / t0)}x; the fastest of its paths at each D).\n"
        f"- At D = {fmt(Dp)}, d = 512, m = 1024 on the H100: {fmt(tp)} ms (`{pp}`) against {fmt(cce)} ms for "
        f"cut-cross-entropy in bf16 ({fmt(cce / tp)}x). The step's target of 0.2 ms is not met.\n"
        f"- At the paper's size (D = {fmt(Dp)}, d = 300, m = 128): {fmt(tpp)} ms on the H100 against the naive head's "
        f"{fmt(naive_host)} ms on the host ({fmt(naive_host / tpp)}x) and {fmt(naive_gpu)} ms on the GPU "
        f"({fmt(naive_gpu / tpp)}x).\n"
        "- On the CPU every baseline's step grows with D and the factored step does not (table below).\n")
    plot = line_panels(panels, "D (classes)", "ms a step")
    return (summary + "\n![step time against D](head_step.svg)\n" + "".join(out)
            + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {"head_step.svg": plot})


# head_step_cpu: the factored step against torch's fused softmax and the naive head (bench_head_cpu.py)

def head_step_cpu_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    full = [r for r in rows if r["run"] == "full"]

    def ms(group, impl, D):
        return next(r["ms"] for r in full if (r["group"], r["impl"], r["D"]) == (group, impl, D))

    lce = [r for r in full if r["group"] == "vs_linear_cross_entropy"]
    nav = [r for r in full if r["group"].startswith("vs_naive")]
    flat = sorted((r for r in full if r["group"] == "flat_in_D"), key=lambda r: r["D"])
    Dl, Dn = lce[0]["D"], nav[0]["D"]
    f_l, o_l = ms("vs_linear_cross_entropy", "factored", Dl), next(r["ms"] for r in lce if r["impl"] != "factored")
    f_n, o_n = next(r["ms"] for r in nav if r["impl"] == "factored"), next(r["ms"] for r in nav if r["impl"] != "factored")
    text = (
        "\n## What holds\n\n"
        f"- Against torch's `F.linear_cross_entropy` + SGD (D = {fmt(Dl)}, d = {lce[0]['d']}, m = {lce[0]['m']}): "
        f"{fmt(f_l)} ms against {fmt(o_l)} ms, **{fmt(o_l / f_l)}x**.\n"
        f"- Against the naive explicit-W head at the paper's CPU size (D = {fmt(Dn)}, d = {nav[0]['d']}, "
        f"m = {nav[0]['m']}): {fmt(f_n)} ms against {fmt(o_n)} ms, **{fmt(o_n / f_n)}x** (the paper reports 763x).\n"
        f"- Flat in D: {fmt(flat[-1]['ms'])} ms at D = {big(flat[-1]['D'])} against {fmt(flat[0]['ms'])} ms at "
        f"D = {big(flat[0]['D'])} ({fmt(flat[-1]['ms'] / flat[0]['ms'])}x).\n\n"
        "`F.linear_cross_entropy` is given explicit chunks of 2^24 logits (its own choice ran 20-40x slower on this "
        "CPU). One torch thread.\n")
    body = [[r["run"], r["group"], r["impl"], r["D"], r["d"], r["m"], r["ms"]] for r in rows]
    return (text + "\n## Every row\n\n" + table(["run", "comparison", "step", "D", "d", "m", "ms"], body, right_from=3)
            + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {})


# whole_step: body + head + optimizers (bench_whole_step.py)

def whole_step_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    out = []
    keys = sorted({(r["machine"], r["tokens"], r["body"]) for r in rows},
                  key=lambda k: (k[0].startswith("NVIDIA"), k))
    for machine, tokens, body in keys:
        cells = [r for r in rows if (r["machine"], r["tokens"], r["body"]) == (machine, tokens, body)
                 and r["head"] != "factored_at_10k" and r["status"] == "ok"]
        Ds = sorted({r["D"] for r in cells})
        names = list(dict.fromkeys(f"{r['head']}/{r['variant']}" for r in cells))
        lines = []
        for n in names:
            by_D = {}
            for r in cells:
                if f"{r['head']}/{r['variant']}" == n:
                    by_D[r["D"]] = r  # the latest row of a head and D
            lines.append([f"`{n}`", *[f"{fmt(by_D[D]['median_ms'])} ({fmt(by_D[D]['ratio'])}x)" if D in by_D else ""
                                      for D in Ds]])
        out.append(f"\n\n## {short_machine(machine)}: {body}, {tokens} tokens a step\n\nMedian ms a whole step, and in "
                   "brackets its ratio to the factored Z-loss model timed beside it on the same batch.\n\n"
                   + table(["head", *[f"D = {big(D)}" for D in Ds]], lines))
    flat = [r for r in rows if r["head"] == "factored_at_10k" and r["status"] == "ok"]
    flat_lines = [[short_machine(r["machine"]), r["body"], f"`{r['variant']}`", r["tokens"], r["D"], r["median_ms"],
                   r["factored_ms"], r["factored_ms"] / r["median_ms"]] for r in flat]
    text = ("\n## Flat in D\n\nThe factored model at D beside the same model at D = 10^4, timed in alternation "
            "(medians; a GPU step's p90 is in the CSV).\n\n"
            + table(["machine", "body", "loss", "tokens", "D", "ms at 10^4", "ms at D", "D / 10^4"], flat_lines,
                    right_from=3))
    return (text + "".join(out) + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {})


# quality: every head for the same time (quality_table.py)

def quality_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    out = []
    key = lambda r: (r["machine"], r["task"], r["num_classes"], r["mode"], r["budget_s"] or 0, r["date"], r["commit"],  # noqa: E731
                     r["clock"] or "")
    groups = sorted({key(r) for r in rows}, key=lambda k: (not k[0].startswith("NVIDIA"), -k[2], k[3], -k[4], k[5], k))
    for k in groups:
        machine, task, D, mode, budget, date, commit, clock = k
        cells = sorted((r for r in rows if key(r) == k), key=lambda r: (-(r["mrr"] or 0), r["head"]))
        lines = [[f"`{r['head']}`", r["train_steps"], r["step_time_ms"], r["mrr"], r["top1_error"], r["top10_error"],
                  r["top100_error"], r["perplexity"]] for r in cells]
        what = (f"{budget} s of training each, validation {'excluded' if clock == 'train' else 'included'}"
                if mode == "budget" else "the same steps")
        out.append(f"\n\n## {short_machine(machine)}: {task}, D = {big(D)}, {what}; `{commit}`, {date}\n\n"
                   + table(["head", "steps", "ms a step", "MRR", "top-1 err", "top-10 err", "top-100 err",
                            "perplexity"], lines))
    note = ("\nValidation metrics (the `budget` runs) or test metrics (the `epochs` runs) on the same held-out "
            "examples for every head of a table; one seed each. `factored-sampled` is `lst-train`'s default head "
            "(the factored head with `loss=sampled`); on one GPU it replays its step from a CUDA graph "
            "(`head.step=auto`), `factored-sampled-eager` is the eager step. Each table is one run of the script "
            "(one commit); compare within a table.\n")
    return note + "".join(out) + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}


# equal_time: lst-train's default against the sampled softmax, seed by seed

def rules():
    """The settings each head takes by D, from the code (one truth: a change of a rule changes the page)."""
    from lst_lightning.heads.samplers import sampled_softmax_num_samples, slots_num_samples  # noqa: PLC0415
    from lst_lightning.losses.sampled_composite import SampledCompositeLoss as L  # noqa: PLC0415

    sampled_lr = float(re.search(r"head_lr:\s*([0-9.]+)", (ROOT / "conf/head/sampled.yaml").read_text()).group(1))

    def default(r: Row) -> bool:
        return (r["head"] == "factored" and r["preconditioner"] == 1 and r["S"] == slots_num_samples(r["D"])
                and r["mu"] == L.default_mu_for(r["D"]) and r["head_lr"] == L.default_lr_for(r["D"]))

    def sampled(r: Row) -> bool:
        return (r["head"] == "sampled_softmax" and r["S"] == sampled_softmax_num_samples(r["D"])
                and r["head_lr"] == sampled_lr)

    return default, sampled


def setting(r: Row) -> str:
    if r["head"] == "sampled_softmax":
        return f"sampled softmax, S {r['S']}, lr {r['head_lr']:g}"
    return f"factored, S {r['S']}, mu {r['mu']:g}, lr {r['head_lr']:g}, {'with' if r['preconditioner'] else 'without'} P"


def regime(r: Row) -> tuple:
    """(D, training examples, time, machine, the row-sparse optimiser of both sides' rows)."""
    return (r["D"], r["train_size"], r["budget_s"], r["machine"], r["embedding"])


def paired(rows: list[Row]) -> dict[tuple, list[tuple[Row, Row]]]:
    """(D, training examples, budget, machine) -> the seeds run by both the default and the sampled
    softmax at their rules: (default's, sampled softmax's) metrics, each the mean of its runs of that seed."""
    default, sampled = rules()
    mine, theirs = defaultdict(list), defaultdict(list)
    for r in rows:
        if default(r):
            mine[(*regime(r), r["seed"])].append(r)
        elif sampled(r):
            theirs[(*regime(r), r["seed"])].append(r)

    def mean(rs: list[Row]) -> Row:
        return {k: statistics.fmean(r[k] for r in rs) for k in ("val_mrr", "val_top10_error")} | {"rows": rs}

    pairs = defaultdict(list)
    for key in sorted(mine.keys() & theirs.keys()):
        pairs[key[:-1]].append((mean(mine[key]), mean(theirs[key])))
    return pairs


def pair_summary(pairs: list[tuple[Row, Row]]) -> dict:
    dm = [a["val_mrr"] - b["val_mrr"] for a, b in pairs]
    dt = [a["val_top10_error"] - b["val_top10_error"] for a, b in pairs]
    return dict(n=len(pairs), mrr=mean_se(dm), top10=mean_se(dt), mrr_ahead=sum(x > 0 for x in dm),
                top10_ahead=sum(x < 0 for x in dt))


def equal_time_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    pairs = paired(rows)
    lines = []
    for (D, ts, budget, machine, emb), ps in sorted(pairs.items()):
        s = pair_summary(ps)
        lines.append([big(D), big(ts), f"{budget} s", short_machine(machine), f"`{emb}`", str(s["n"]),
                      with_se(s["mrr"]), f"{s['mrr_ahead']} of {s['n']}",
                      with_se(s["top10"]), f"{s['top10_ahead']} of {s['n']}"])
    text = ("\n`lst-train`'s own command on the synthetic Zipf task for a fixed time, the lr decaying over it "
            "(`scheduler.over=budget`), validation on the same held-out examples: **the default** (the factored "
            "head, `loss=sampled`, its right preconditioner P, S, mu and lr by D as the code sets them) against "
            "**the sampled softmax** (row-sparse rows, S by D as the code sets it, its tuned lr). Both sides' "
            "row-sparse rows (the input embedding's, the sampled softmax's) under one optimiser, `optimizer.embedding`: "
            "torch's `sparse_adam`, or `row_adam` (the same arithmetic in static shapes). "
            "The rules are read from the code, so a change of a default changes which rows count. The time is "
            "training time, validation excluded: each run validates once, after its time is spent.\n\n"
            "## The default against the sampled softmax, seed for seed\n\n"
            "Differences are the default's minus the sampled softmax's (mean ± standard error over seeds): MRR "
            "higher is better, top-10 error lower is better.\n\n"
            + table(["D", "training examples", "time", "machine", "rows under", "seeds", "MRR", "default ahead",
                     "top-10 error", "default ahead"], lines, right_from=5))
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[(*regime(r), setting(r))].append(r)
    all_lines = []
    for (D, ts, budget, machine, emb, name), rs in sorted(groups.items()):
        mrr, top10 = mean_se([r["val_mrr"] for r in rs]), mean_se([r["val_top10_error"] for r in rs])
        all_lines.append([big(D), big(ts), f"{budget} s", short_machine(machine), f"`{emb}`", name, str(len(rs)),
                          f"{fmt(mrr[0])}", f"{fmt(top10[0])}", fmt(statistics.fmean(r["steps"] for r in rs))])
    text += ("\n\n## Every setting run\n\nMeans over the seeds run (one row of the CSV a seed).\n\n"
             + table(["D", "training examples", "time", "machine", "rows under", "setting", "seeds", "MRR",
                      "top-10 error", "steps"], all_lines, right_from=6))
    return text + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}


# time_to_quality: the default against its rival side by side, with validation curves (time_to_quality.py)

#: the heads a pair's rival may be, in order of preference: a lever is measured against the default
RIVALS = ("sampled_softmax", "default")
CASE_NAMES = {"wiki": "real: the Wikipedia extract (`data=wiki`)", "python_code": "real: Python code (`data=python_code`)", "linux_source": "real: Linux C (`data=linux_source`)",
              "synthetic_1e5": "synthetic Zipf", "synthetic_1e6": "synthetic Zipf", "synthetic_1e7": "synthetic Zipf"}
HEAD_NAMES = {"default": "the default", "sampled_softmax": "the sampled softmax", "softmax": "the full softmax",
              "default_no_P": "the default without P",
              "sampled_preconditioned": "the sampled softmax with P (`head=sampled_preconditioned`)"}


def variant_name(head: str) -> str:
    """A head of time_to_quality.py as a page names it: a variant of one by the settings it changes
    (of the default: the settings alone; of another head: its name first)."""
    name, *extra = head.split(";")
    settings = ", ".join(f"`{e}`" for e in extra)
    if not extra:
        return HEAD_NAMES.get(name, name)
    return settings if name == "default" else f"{HEAD_NAMES.get(name, name)}, {settings}"


def rival_rank(head: str) -> tuple[int, bool]:
    """How much ``head`` is preferred as a pair's rival (lower: more): by its name's place in
    RIVALS, a head as shipped before a variant of it."""
    name = head.split(";")[0]
    return (RIVALS.index(name) if name in RIVALS else len(RIVALS), ";" in head)


def ttq_pairs(rows: list[Row]) -> dict[tuple, list[tuple[Row, Row]]]:
    """(case, D, budget, machine, ours, rival) -> per seed (our row, the rival's row), equal-time rows only.
    A pair run again (the same case, budget, machine, seed and heads) stands for the earlier one: the
    code as it is measured last (the rows keep both, each with its commit)."""
    latest = {(r["case"], r["budget_s"], r["machine"], r["seed"], r["head"], r["rival"]): r
              for r in rows if r["mode"] == "equal_time"}  # the last row of each: the file's order
    runs = list(latest.values())
    by = {(r["case"], r["budget_s"], r["machine"], r["seed"], r["commit"], r["head"], r["rival"]): r for r in runs}
    out = defaultdict(list)
    for r in runs:
        rival = r["rival"]
        if rival.split(";")[0] not in RIVALS or rival_rank(r["head"]) <= rival_rank(rival):
            continue  # each pair once: ours is the head that is not the preferred rival
        other = by.get((r["case"], r["budget_s"], r["machine"], r["seed"], r["commit"], rival, r["head"]))
        if other is not None:
            out[(r["case"], r["D"], r["budget_s"], r["machine"], r["head"], rival)].append((r, other))
    return out


def ttq_summary(ps: list[tuple[Row, Row]]) -> dict:
    dm = [a["val_mrr"] - b["val_mrr"] for a, b in ps]
    dt = [a["val_top10_error"] - b["val_top10_error"] for a, b in ps]
    mine = [a["reach_ratio"] for a, _ in ps]
    theirs = [b["reach_ratio"] for _, b in ps]

    def ratio(xs: list) -> str:
        got = [x for x in xs if x is not None]
        text = fmt(statistics.fmean(got), 2) if got else "never"
        return text if len(got) == len(xs) else f"{text} ({len(got)} of {len(xs)})"

    return dict(n=len(ps), mrr=mean_se(dm), top10=mean_se(dt), ahead=sum(x > 0 for x in dm),
                top10_ahead=sum(x < 0 for x in dt), ours=statistics.fmean(a["val_mrr"] for a, _ in ps),
                rival=statistics.fmean(b["val_mrr"] for _, b in ps),
                steps=statistics.fmean(a["steps"] / b["steps"] for a, b in ps), reach=ratio(mine),
                reach_rival=ratio(theirs), load=statistics.fmean(a["load_mean"] for a, _ in ps),
                apart=any(a.get("together") == 0 for a, _ in ps))


def time_to_quality_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    lines = []
    pairs = ttq_pairs(rows)
    order = list(CASE_NAMES)
    for (case, D, budget, machine, ours, rival), ps in sorted(
            pairs.items(), key=lambda kv: (kv[0][4] != "default", order.index(kv[0][0]) if kv[0][0] in order else 99,
                                           kv[0][1], kv[0][2], kv[0][4])):
        s = ttq_summary(ps)
        lines.append([CASE_NAMES.get(case, case), big(D), variant_name(ours), variant_name(rival),
                      f"{budget:g} s", short_machine(machine), str(s["n"]), fmt(s["ours"]), fmt(s["rival"]),
                      with_se(s["mrr"]), f"{s['ahead']} of {s['n']}", with_se(s["top10"]),
                      f"{s['top10_ahead']} of {s['n']}", fmt(s["steps"], 2), s["reach"], s["reach_rival"],
                      fmt(s["load"], 2) + (" (apart)" if s["apart"] else "")])
    text = ("\nEach pair: two `lst-train` processes started together, one torch thread each, same seed, each "
            "trained for the same budget of its own CPU time (`clock=cpu`, validation excluded), validating "
            "every sixth of it and at its end on the same held-out examples. The CPU clock gives both sides the "
            "same work whatever the machine's other jobs do; running them together gives both the same load "
            "(`load`: the 1-minute load average while the pair ran, of 2 cores; `apart`: the two ran one after the "
            "other, as `time_to_quality.py --apart` runs them where they do not fit in memory together). **the default**: `lst-train`'s "
            "head as the code sets it by D; **the sampled softmax**: `head=sampled`, row-sparse rows under "
            "SparseAdam, S by D and its swept lr, as the project tunes it. A run that compiles (`compile=true`: the "
            "body and the rival's forward, backward and row update; `head.compile_step=true`: the default's step) "
            "compiles cold, its tracing and code generation in its own process (`TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 "
            "TORCHINDUCTOR_COMPILE_THREADS=1`, which the script sets), so those are in its budget; the C++ compiler "
            "runs as a child process, whose CPU time the clock does not count.\n\n"
            "`time to the rival's MRR`: the training time at which a head's validation curve (linear between "
            "validations) first reached the rival's final MRR, over the rival's own training time: below 1, it "
            "got there sooner; `never`: not within its budget (with how many seeds did).\n\n"
            "## At equal time\n\nDifferences are ours minus the rival's (mean ± standard error over seeds).\n\n"
            + table(["corpus", "D", "ours", "rival", "CPU time", "machine", "seeds", "MRR", "rival's MRR",
                     "MRR difference", "ahead", "top-10 error difference", "ahead", "steps / rival's",
                     "time to the rival's MRR", "the rival's time to ours", "load"], lines, right_from=6))
    variants = [r for r in rows if r["mode"] == "equal_time" and r["head"].startswith("default;")]
    if variants:
        var_lines = [[CASE_NAMES.get(r["case"], r["case"]), big(r["D"]), f"{r['budget_s']:g} s",
                      short_machine(r["machine"]), str(r["seed"]), variant_name(r["head"]), variant_name(r["rival"]),
                      fmt(r["steps"]), fmt(r["val_mrr"]), fmt(r["val_top10_error"]), fmt(r["load_mean"], 2)]
                     for r in sorted(variants, key=lambda r: (r["case"], r["seed"], r["head"]))]
        text += ("\n\n## Settings of the default, tried at equal time\n\nA row: one run of the default with the "
                 "settings named changed (`time_to_quality.py --heads 'default;key=value;...,...'`), paired as above "
                 "with the run named beside it; the default's other settings as the code sets them.\n\n"
                 + table(["corpus", "D", "CPU time", "machine", "seed", "settings changed", "run beside it", "steps",
                          "MRR", "top-10 error", "load"], var_lines, right_from=7))
    same = [r for r in rows if r["mode"] == "same_steps"]
    if same:
        curves = load("time_to_quality_curves")
        groups: dict[tuple, dict] = defaultdict(dict)
        for c in curves:
            if c["mode"] == "same_steps":  # by the run's length too: the lr's decay spans it
                length = int(re.search(r"trainer\.max_steps=(\d+)", c["command"]).group(1))
                groups[(c["case"], c["D"], c["machine"], length, c["step"])].setdefault(
                    c["head"], defaultdict(list))[c["seed"]].append(c["val_mrr"])  # a seed run again: both runs
        heads = [h for h in ("default", "sampled_softmax", "softmax") if any(r["head"] == h for r in same)]
        heads += sorted({r["head"] for r in same if r["head"].startswith("softmax;")})  # the full softmax's lrs
        heads += sorted({r["head"] for r in same if r["head"].startswith("default;")})  # the default's settings tried
        heads += sorted({r["head"] for r in same if r["head"] not in heads})  # the other heads and their variants
        step_lines = []
        for (case, D, machine, length, step), by_head in sorted(groups.items()):
            step_lines.append([CASE_NAMES.get(case, case), big(D), short_machine(machine), fmt(length), fmt(step),
                               str(most := max(len(v) for v in by_head.values())),
                               *[(fmt(statistics.fmean(v for runs in by_head[h].values() for v in runs))
                                  + ("" if len(by_head[h]) == most else f" (seed {', '.join(map(str, sorted(by_head[h])))})"))
                                 if h in by_head else "" for h in heads]])
        text += ("\n\n## After the same number of steps, against the full softmax\n\nValidation MRR at each "
                 "validation of runs of a fixed number of steps (time plays no part; the lr's warm-up and decay span "
                 "the run's steps), the mean over the seeds run (a head run on fewer seeds names its own): the full softmax "
                 "(`head=softmax`, at its configured lr and at the lrs named) takes the exact gradient of the whole "
                 "loss each step.\n\n"
                 + table(["corpus", "D", "machine", "steps a run", "step", "seeds",
                          *[HEAD_NAMES.get(h) or (f"the default, {variant_name(h)}" if h.startswith("default;")
                                                  else variant_name(h)) for h in heads]], step_lines,
                         right_from=3))
    text += ("\n\nEvery validation of every run (the curves): "
             "[benchmarks/results/time_to_quality_curves.csv](../../benchmarks/results/time_to_quality_curves.csv).")
    return text + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}


# checkpoints (bench_checkpoints.py)

def checkpoints_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    lines = [[big(r["D"]), r["setting"], r["long_steps"], r["step_ms"], r["ratio_to_none"], r["periodic_saves"],
              r["save_held_s"], r["save_written_s"], f"{fmt(100 * r['in_run_share'], 2)} %", r["ckpt_mb"]] for r in rows]
    text = ("\n`lst-train` on the synthetic task (input vocabulary = D), no validation. `in-run share`: the periodic "
            "saves' seconds (the longer of the time a save held training and the time until it was on disk) over "
            "the run's training wall time, measured inside the long run. `ratio` compares the per-step time of "
            "two runs (their wall-time difference over their step difference): a noisy measure, about ±10 % on "
            "this machine. Settings: `none` (no periodic save), `default` (every 10 minutes and after validation, "
            "within 5 % of the wall time, written in the background), `budget` (the same rule with a save due "
            "every 0.6 s).\n\n"
            + table(["D", "setting", "long run (steps)", "ms a step", "ratio to none", "periodic saves",
                     "held (s)", "on disk (s)", "in-run share", "checkpoint (MB)"], rows=lines, right_from=2))
    return text + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}


def plain_body(columns: list[tuple[str, str]], about: str = "") -> Callable[[list[Row]], tuple[str, dict[str, str]]]:
    """A page that lists every row: ``columns`` as (CSV column, heading)."""
    def body(rows: list[Row]) -> tuple[str, dict[str, str]]:
        text = (f"\n{about}\n" if about else "") + "\n" + table(
            ["machine", *[h for _, h in columns]],
            [[short_machine(r["machine"]), *[r[c] if r[c] is not None else "" for c, _ in columns]] for r in rows],
            right_from=1 + sum(1 for c, _ in columns if c in TEXT))
        return text + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}
    return body


def configured_head_lr(head: str) -> float:
    """A baseline's ``optimizer.head_lr`` as its config sets it (conf/head/<head>.yaml)."""
    return float(re.search(r"head_lr:\s*([0-9.]+)", (ROOT / "conf" / "head" / f"{head}.yaml").read_text()).group(1))


def baseline_lr_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    lrs = sorted({r["head_lr"] for r in rows})
    lines = []
    for head in dict.fromkeys(r["head"] for r in rows):
        by_lr = {r["head_lr"]: r for r in rows if r["head"] == head}
        best = max(by_lr.values(), key=lambda r: r["val_mrr"])["head_lr"]
        cells = []
        for lr in lrs:
            r = by_lr.get(lr)
            cell = "" if r is None else fmt(r["val_mrr"]) + (f" ({fmt(r['test_mrr'])})" if r["test_mrr"] else "")
            cells.append(f"**{cell}**" if r is not None and lr == best else cell)
        lines.append([f"`head={head}`", *cells, f"{configured_head_lr(head):g}"])
    text = ("\nEach ordinary head's own lr (`optimizer.head_lr`, Adam on its parameters; the body at "
            "`optimizer.lr=0.002`), 1 000 steps of the synthetic task at D = 10^4, the n-gram body, seed 0: "
            "validation MRR on 4 096 held-out examples (the test MRR in brackets), the best in bold. The last "
            "column is the lr each head's config sets (read from `conf/head/<head>.yaml`). The full softmax's "
            "best here, 0.512, does not carry over to the embedded corpus, where 0.128 is within 0.006 of the best.\n\n"
            + table(["head", *[f"{lr:g}" for lr in lrs], "configured"], lines))
    return text + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}


def two_commands_body(rows: list[Row]) -> tuple[str, dict[str, str]]:
    train = [r for r in rows if r["what"] == "lst-train"]
    tests = [r for r in rows if r["what"] == "pytest"]
    text = "\n## `uv run lst-train`\n\n" + table(
        ["machine", "date", "wall (s)", "ms a step", "steps", "test MRR", "test top-10 error", "unigram MRR",
         "unigram top-10 error"],
        [[short_machine(r["machine"]), r["date"], r["wall_s"], r["ms_per_step"], r["steps"], r["test_mrr"],
          r["test_top10_error"], r["unigram_mrr"], r["unigram_top10_error"]] for r in train], right_from=2)
    text += "\n\nThe wall time includes the start, validation and the test split; uv's cache was warm.\n"
    text += "\n## `uv run pytest`\n\n" + table(
        ["machine", "date", "wall (s)", "passed", "skipped"],
        [[short_machine(r["machine"]), r["date"], r["wall_s"], r["passed"], r["skipped"]] for r in tests], right_from=2)
    return text + "\n\n## Where the rows come from\n\n" + provenance(rows) + "\n", {}


PAGE_LIST = [
    Page("two_commands", "The two commands", "`uv run lst-train` and `uv run pytest` on a fresh checkout",
         "A row: one run of `uv run lst-train` (the default model on the embedded corpus) or of the test suite.",
         two_commands_body),
    Page("head_step", "The output layer's step, every head", "scripts/bench_heads.py",
         "A row: one head (`head/variant`) at one size (D classes, hidden size d, m rows a step) on one machine: "
         "the median, 10th and 90th percentile of its step (forward, backward, update). The spherical heads keep "
         "float32 state; on a GPU the softmax-family baselines run in bf16.", head_step_body),
    Page("head_step_cpu", "The factored step against torch and the naive head, on CPU", "scripts/bench_head_cpu.py",
         "A row: one step (the factored head's, or the one it is compared with) at one size, each comparison timed "
         "in alternation (median).", head_step_cpu_body),
    Page("whole_step", "The whole training step against D", "scripts/bench_whole_step.py",
         "A row: the whole training step (body forward and backward, the head, the optimizers) of one body and head "
         "at one D, input vocabulary = D, with a row-sparse input embedding under SparseAdam; every model is timed "
         "in alternation with the factored Z-loss model on the same batch (`ratio`).", whole_step_body),
    Page("equal_time", "The default against the sampled softmax at equal time", "`uv run lst-train` (the command in each row)",
         "A row: one `lst-train` run for a fixed time: its setting, seed, steps and validation metrics.",
         equal_time_body),
    Page("time_to_quality", "Time to quality: the default against its rival, side by side",
         "scripts/time_to_quality.py",
         "A row: one `lst-train` run of a pair (or of a fixed number of steps): its final validation metrics, steps, "
         "and the training time it took to reach its rival's final validation MRR.", time_to_quality_body),
    Page("quality", "Every head trained for the same time", "scripts/quality_table.py",
         "A row: one head trained with the n-gram MLP body for a fixed time (`budget`) or number of steps "
         "(`epochs`), its validation or test metrics and step time.", quality_body),
    Page("baseline_lr", "The baselines' lr", "`uv run lst-train` (the command in each row)",
         "A row: one baseline head trained at one lr of its own (`optimizer.head_lr`).", baseline_lr_body),
    Page("checkpoints", "What checkpoints cost", "scripts/bench_checkpoints.py",
         "A row: one checkpoint setting at one D: the step time, the periodic saves made in the long run and "
         "their share of its wall time.", checkpoints_body),
    Page("routes", "Every multi-process route on two processes", "scripts/bench_routes.py",
         "A row: one route (`lst-train` DDP or FSDP2, the HF Trainer, litgpt under Fabric) with the head replicated "
         "or sharded, two gloo processes on one machine: bytes each rank sends a step and the time a step.",
         plain_body([("route", "route"), ("head", "head"), ("D", "D"), ("bytes_per_step", "bytes a rank a step"),
                     ("head_bytes_per_step", "the head's bytes"), ("body_allreduce_bytes", "body all-reduce bytes"),
                     ("ms_per_step", "ms a step"), ("max_rss_mb", "max RSS (MB)")],
                    "d = 128, 256 head rows per rank, 20 timed steps after 3; `lst-train` with its default "
                    "`loss=sampled`, the HF and litgpt routes with the Z-loss.")),
    Page("sharded", "The vocabulary-sharded head over processes", "scripts/bench_sharded.py",
         "A row: the sharded head at one D over `world` gloo processes on one machine.",
         plain_body([("D", "D"), ("d", "d"), ("world", "processes"), ("global_batch", "global batch"),
                     ("step_ms", "ms a step"), ("v_gb_per_rank", "V per rank (GB)"),
                     ("comm_mb_per_step", "MB exchanged a step"), ("setup_s", "setup (s)")],
                    "Two processes and the machine's other jobs share 2 cores; the global batch doubles with the "
                    "processes and the m x m terms of the step quadruple.")),
    Page("sparse_exchange", "The row-sparse gradient exchange", "scripts/bench_sparse_exchange.py",
         "A row: the exchange of a row-sparse input embedding's gradient over `world` gloo processes at one D: "
         "torch's sparse gradient (`coo`: the distinct rows, their counts read on the host) or static rows "
         "(`static`, `optimizer.embedding=row_adam`: every lookup's row, in fixed shapes, no host read).",
         plain_body([("gradient", "gradient"), ("D", "D"), ("d", "d"), ("world", "processes"), ("rows_touched_max", "rows touched (max)"),
                     ("bytes_per_step", "bytes a step"), ("dense_grad_bytes", "a dense gradient's bytes"),
                     ("exchange_ms", "ms an exchange")])),
    Page("mixed_precision_drift", "bf16-mixed against float32 training", "scripts/mixed_precision_drift.py",
         "A row: the same training in bf16-mixed and in float32 (same seed and data): how far apart the head's W "
         "and the body end.",
         plain_body([("route", "route"), ("head", "head"), ("loss", "loss"), ("steps", "steps"),
                     ("rel_diff_W", "rel. diff of W"), ("diff_over_update_W", "the same over W's update"),
                     ("rel_diff_body", "rel. diff of the body")],
                    "`user_module`: a plain LightningModule (D = 2000, d = 32); `lst_train`: "
                    "`lst-train experiment=tiny`.")),
    Page("samplers", "The kernel samplers: tree against direct sampling", "scripts/bench_samplers.py",
         "A row: one kernel proposal over n classes: drawing through the sum tree against computing all n kernel "
         "values and `torch.multinomial`.",
         plain_body([("kernel", "kernel"), ("n", "n"), ("feature_dim", "features"), ("direct_ms", "direct (ms)"),
                     ("tree_ms", "tree (ms)"), ("direct_over_tree", "direct / tree"),
                     ("tree_update_ms", "tree update (ms)")],
                    "16 rows x 64 draws a call, d = 32, one thread.")),
    Page("compiled_step", "The factored step compiled whole", "scripts/compiled_step.py",
         "A row: the factored head's step at one size, its device part compiled by `torch.compile(fullgraph=True)`: "
         "graph breaks, Inductor's kernels a step (fused loops, matrix products, other calls, read from the code it "
         "generates), compile time, and the step's time eager, compiled (lst-train's fused step), compiled inside a "
         "CUDA graph (GPU), and compiled as the autograd step (a plain loop, Fabric) and as exact accumulation's "
         "(the HF Trainer), timed in alternation (median).",
         plain_body([("device", "device"), ("loss", "loss"), ("inverse", "U_new^-1 by"), ("D", "D"), ("d", "d"),
                     ("m", "m"), ("factors", "Neumann factors"), ("graphs", "graphs"), ("breaks", "breaks"),
                     ("fused_loops", "fused loops"),
                     ("products", "products"), ("other_calls", "other calls"), ("kernels", "kernels"),
                     ("compile_s", "compile (s)"), ("eager_ms", "eager (ms)"), ("compiled_ms", "compiled (ms)"),
                     ("graph_ms", "in a graph (ms)"), ("autograd_ms", "autograd (ms)"),
                     ("accumulated_ms", "accumulated (ms)")],
                    "`loss=sampled` is lst-train's default head (S = 512 shared negatives from 10^5 classes, the "
                    "right preconditioner); `products` is the GPU's route to U_new^-1. On a CPU, one thread. "
                    "The GPU targets at D = 793 471, d = 512, m = 1024: at most 45 kernels and 0.4 ms for the "
                    "Z-loss, 70 and 0.6 ms for the default; the autograd and accumulated steps within 1.2 x the "
                    "graph step.")),
    Page("compiled_batch_sizes", "Batches of any size through the compiled step", "scripts/compiled_step.py --batch-sizes",
         "A row: lst-train's default head, its step compiled (`compile_step=True`) and fed batches of changing size "
         "(docs/factored_head.md, \"Batch shapes\"): the fused step of m rows padded to its batch size against the "
         "step of exactly m rows (a head whose one batch size is m), timed in alternation (median); then 30 random "
         "sizes from 1 to m (1 first) through a fresh head as lst-train steps it (fused; on a GPU from a CUDA graph a "
         "batch size): the graphs compiled, the graphs captured (GPU), and the seconds of the 30 steps, compiles "
         "included.",
         plain_body([("device", "device"), ("loss", "loss"), ("inverse", "U_new^-1 by"), ("D", "D"), ("d", "d"),
                     ("m", "m"), ("padded_to", "padded to"), ("static_ms", "exactly m (ms)"),
                     ("padded_ms", "padded (ms)"), ("padded_over_static", "padded / exactly m"),
                     ("sizes", "random sizes"), ("largest", "largest"), ("graphs", "graphs"),
                     ("sizes_s", "their steps (s)"), ("captures", "CUDA graphs")],
                    "Targets: the padded step at most 1.15 x the step of exactly m rows; at most log2(largest) + 2 "
                    "graphs over the random sizes. On a CPU, one thread.")),
    Page("crossover", "Where the factored head pays, by its arithmetic", "scripts/crossover.py",
         "A row: lst-train's default factored step (`loss=sampled`, the GPU's step) at one width d and m rows a step, "
         "counted by `scripts/count_step.py` (its matrix products' FLOPs), and what it is worth in softmax classes.",
         plain_body([("d", "d"), ("m", "m"), ("units", "units of 2 m d^2"), ("gflop", "GFLOP"),
                     ("products", "products"), ("operators", "operators"),
                     ("crossover_D", "full softmax as costly at D ="), ("S", "sampled softmax's S"),
                     ("vs_sampled", "x its step"), ("measured_D", "measured crossover D"),
                     ("measured_on", "measured on")],
                    "A full softmax (fused or not) makes 6 m D d FLOPs a step, the sampled softmax with S shared "
                    "classes about 6 m S d: the full softmax costs as much as the factored step at D = FLOPs / "
                    "(6 m d), the sampled softmax at S = the same number. The factored step's count holds for "
                    "every D from 10^5 to 10^7 (the same 512 sampled slots; counted at D = 10^5). The measured "
                    "crossover, where a GPU's `bench_heads.py --sweep-d` gives one: the D at which the faster "
                    "fused softmax in bf16 takes as long as the default step.")),
    Page("launch_cost", "What one kernel launch costs", "scripts/launch_cost.py",
         "A row: the microseconds of one launch, the unit a launch-bound step time is read against: an empty "
         "Triton kernel and a one-element torch operator launched back to back from Python (the host's cost a "
         "launch), and one node of a CUDA graph of empty Triton kernels replayed (the graph step's). The median "
         "of 5 repeats, one torch thread.",
         plain_body([("device", "device"), ("unit", "unit"), ("note", "what"), ("launches", "launches"),
                     ("us", "us each")])),
    Page("gpu_checks", "The CUDA tests", "scripts/gpu_session.py tests kernels",
         "A row: one run of the gpu-marked tests or of the kernel tests on a GPU, from the suite's junit XML.",
         plain_body([("check", "tests"), ("passed", "passed"), ("failed", "failed"), ("skipped", "skipped"),
                     ("seconds", "seconds")],
                    "The two failures at commit cbc5480 are "
                    "`test_graph_step_with_adaptive_factors_is_the_eager_step_bit_for_bit` (the opt-in "
                    "`neumann=adaptive` step, its graph captured again mid-run); `tests/spherical/test_graph_step.py` "
                    "holds that step on the CPU. The rows at commit d68288a were cut at their limits: 296 of the 305 "
                    "kernel tests ran and passed; the gpu-marked tests ran one at a time, and the first six, the "
                    "compiled step's CUDA tests in `tests/spherical/test_compiled.py` (equal to the eager step and "
                    "the naive head; no host synchronisation on four routes), failed, their reasons not printed. "
                    "Two faults of those tests, each shown on the CPU, account for them: the float32 head started "
                    "from another W than the naive head (a float32 head draws another initial W from the same "
                    "seed), and a read just before the checked steps changed the Neumann factors, so the first "
                    "checked step compiled a graph (and captured one). The tests give every head one W and "
                    "read until the factors settle (`test_after_the_factors_settle_the_compiled_steps_compile_nothing`). "
                    "The suite prints each failure's reason when it happens, so a run cut short still names them.")),
]
PAGES_BY_NAME = {p.name: p for p in PAGE_LIST}


# --- the README's key figures ----------------------------------------------------------------

@dataclass
class Figure:
    what: str
    value: str
    rows: list[Row]
    page: str


def where(rows: list[Row]) -> str:
    """'machine, torch x, date' of the rows a figure comes from."""
    ms = sorted({short_machine(r["machine"]) for r in rows})
    ts = sorted({short_torch(r["torch"]) for r in rows})
    ds = sorted({r["date"] for r in rows})
    return f"{' and '.join(ms)}, torch {' and '.join(ts)}, {ds[0] if len(ds) == 1 else ds[0] + ' to ' + ds[-1]}"


def compiled_step_figure() -> Figure:
    """The compiled step replayed from its CUDA graph at the GPU targets' size, the latest row of
    each loss, beside its target (gpu_targets.py's, which compiled_step.py checks), PASS or FAIL."""
    size = (TARGET["D"], TARGET["d"], TARGET["m"])
    rows = {r["loss"]: r for r in load("compiled_step") if r["device"] == "cuda" and (r["D"], r["d"], r["m"]) == size}
    cells = []
    for loss, name in (("zloss", "the Z-loss"), ("sampled", "the default")):
        ms = rows[loss]["graph_ms"]
        cells.append(f"{name} {fmt(ms)} ms (target {MAX_MS[loss]:g}: **{verdict(ms, MAX_MS[loss])}**)")
    D = f"{size[0]:,}".replace(",", " ")
    return Figure(f"the compiled step on a GPU, from its CUDA graph, D = {D}, d = {size[1]}, m = {size[2]}",
                  ", ".join(cells), list(rows.values()), "compiled_step")


def key_figures() -> list[Figure]:
    figs = []
    two = [r for r in load("two_commands") if r["what"] == "lst-train"][-1]
    figs.append(Figure("`uv run lst-train`, the default, from start to its metrics",
                       f"{fmt(two['wall_s'])} s, {fmt(two['ms_per_step'])} ms a step; test MRR {fmt(two['test_mrr'])} "
                       f"against the unigram's {fmt(two['unigram_mrr'])}", [two], "two_commands"))
    cpu = [r for r in load("head_step_cpu") if r["run"] == "full"]
    lce = [r for r in cpu if r["group"] == "vs_linear_cross_entropy"]
    f, o = (next(r["ms"] for r in lce if (r["impl"] == "factored") == want) for want in (True, False))
    figs.append(Figure(f"head step, factored vs torch `F.linear_cross_entropy` + SGD, D = {fmt(lce[0]['D'])}, "
                       f"d = {lce[0]['d']}, m = {lce[0]['m']}", f"{fmt(f)} vs {fmt(o)} ms: **{fmt(o / f)}x**",
                       lce, "head_step_cpu"))
    steps = load("head_step")
    gpu = "NVIDIA-H100-80GB-HBM3"
    t0, _ = fastest_factored(steps, gpu, 10_000, 512, 1024)
    t1, _ = fastest_factored(steps, gpu, 20_000_000, 512, 1024)
    tp, pp = fastest_factored(steps, gpu, 793_471, 512, 1024)
    cce = ok_ms(steps, gpu, "softmax/cce", 793_471, 512, 1024)
    used = [r for r in steps if r["machine"] == gpu and r["d"] == 512 and r["m"] == 1024]
    figs.append(Figure("head step on a GPU, D = 793 471, d = 512, m = 1024: factored (CUDA graph) vs cut-cross-entropy (bf16)",
                       f"{fmt(tp)} vs {fmt(cce)} ms: **{fmt(cce / tp)}x**", used, "head_step"))
    figs.append(Figure("head step on a GPU, D = 2 x 10^7 against D = 10^4 (d = 512, m = 1024)",
                       f"{fmt(t1)} / {fmt(t0)} ms: **{fmt(t1 / t0)}**", used, "head_step"))
    figs.append(compiled_step_figure())
    whole = [r for r in load("whole_step") if r["machine"] == "NVIDIA-H200" and r["D"] == 1_000_000
             and r["body"] == "ngram_mlp" and r["status"] == "ok"]
    mine = next(r for r in whole if (r["head"], r["variant"]) == ("factored_graph", "sampled"))
    theirs = next(r for r in whole if (r["head"], r["variant"]) == ("sampled", "log_uniform,sparse"))
    figs.append(Figure("whole step on a GPU, D = 10^6, n-gram MLP, 2 048 tokens: the default (CUDA graph) vs the "
                       "sampled softmax", f"{fmt(mine['median_ms'])} vs {fmt(theirs['median_ms'])} ms",
                       [mine, theirs], "whole_step"))
    q = [r for r in load("quality") if r["machine"] == "NVIDIA-H200" and r["budget_s"] == 45]
    a, b = (next(r for r in q if r["head"] == h) for h in ("factored-sampled", "sampled-log_uniform"))
    figs.append(Figure("validation MRR after 45 s of training (validation excluded) on a GPU, D = 10^6: the default "
                       "vs the sampled softmax",
                       f"**{fmt(a['mrr'])}** vs {fmt(b['mrr'])} (top-10 error {fmt(a['top10_error'])} vs "
                       f"{fmt(b['top10_error'])})", [a, b], "quality"))
    eq = load("equal_time")
    key = (1_000_000, 4_000_000, 150)
    ps = [p for k, v in paired(eq).items() if k[:3] == key for p in v]
    s = pair_summary(ps)
    figs.append(Figure("validation MRR after 150 s of training (validation excluded) on a CPU, D = 10^6, every "
                       "example seen once: the default minus the sampled softmax", f"{signed(s['mrr'][0])} (ahead on {s['mrr_ahead']} seeds of {s['n']}; "
                       f"top-10 error {signed(s['top10'][0])})", [r for p in ps for side in p for r in side["rows"]],
                       "equal_time"))
    return figs


def key_figures_block() -> str:
    lines = [KEY_START, "", "| what | figure | measured on |", "|---|---|---|"]
    for f in key_figures():
        lines.append(f"| {f.what} | {f.value} | [{where(f.rows)}](docs/results/{f.page}.md) |")
    return "\n".join([*lines, "", KEY_END])


#: the real corpus that answers for a row of the "which head" table (its D cell)
REAL_CASES = {"10^4": ("wiki", "the Wikipedia extract"), "10^5": ("python_code", "Python code"),
              "10^6": ("linux_source", "Linux C")}


def real_cell(case: str, label: str) -> str:
    """Which head won at equal time on the real corpus ``case``, the default against the sampled
    softmax: the one ahead on both measures on every seed, else "mixed"; the mean differences."""
    pairs = [(k, ps) for k, ps in ttq_pairs(load("time_to_quality")).items()
             if k[0] == case and k[4:] == ("default", "sampled_softmax")]
    if not pairs:
        return "not measured"
    (_, _, budget, *_), ps = max(pairs, key=lambda kv: (len(kv[1]), kv[0][2]))
    s = ttq_summary(ps)
    n = s["n"]
    both = s["ahead"] + s["top10_ahead"]
    winner = "**the default**" if both == 2 * n else "the sampled softmax" if both == 0 else "mixed"
    return (f"{winner}: on {label} the default's MRR {signed(s['mrr'][0])} (ahead on {s['ahead']} of {n} seeds), "
            f"top-10 error {signed(s['top10'][0])} (lower on {s['top10_ahead']}), {budget:g} s of CPU each "
            "([time to quality](docs/results/time_to_quality.md))")


def which_head_table(block: str) -> str:
    """The "which head" table with its real-code column (after the CPU column) made from the data."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
    head, body = rows[0], rows[2:]
    if REAL_COLUMN not in head:
        at = head.index("CPU") + 1
        head.insert(at, REAL_COLUMN)
        for r in body:
            r.insert(at, "")
    at = head.index(REAL_COLUMN)
    for r in body:
        r[at] = real_cell(*REAL_CASES[r[0]]) if r[0] in REAL_CASES else "" if not r[0].startswith("10^") else "not measured"
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


def readme_text(current: str) -> str:
    """The README with its key-figures block and its "which head" table's real-code column made anew."""
    a, b = current.index(KEY_START), current.index(KEY_END) + len(KEY_END)
    current = current[:a] + key_figures_block() + current[b:]
    a, b = current.index(WHICH_START) + len(WHICH_START), current.index(WHICH_END)
    return current[:a] + "\n" + which_head_table(current[a:b]) + "\n" + current[b:]


# --- everything the script makes -------------------------------------------------------------

def index_page() -> str:
    lines = ["# Results", "",
             "One page per benchmark, each made by `scripts/results_pages.py` from its tidy CSV in "
             "[benchmarks/results/](../../benchmarks/results/README.md) (numeric columns, and the machine, torch "
             "version, commit, date and command of every row). `uv run python scripts/results_pages.py` remakes "
             "them all; `tests/scripts/test_results_pages.py` fails when a page differs from what the data makes.",
             "", "| page | measured by | machines |", "|---|---|---|"]
    for p in PAGE_LIST:
        ms = sorted({short_machine(r["machine"]) for r in load(p.name)})
        lines.append(f"| [{p.title}]({p.name}.md) | {code(p.script)} | {', '.join(ms)} |")
    return "\n".join(lines) + "\n"


def expected() -> dict[Path, str]:
    """Every file this script makes, with its text."""
    files = {PAGES / "README.md": index_page()}
    for p in PAGE_LIST:
        body, plots = p.body(load(p.name))
        files[PAGES / f"{p.name}.md"] = header(p) + body
        files.update({PAGES / name: text for name, text in plots.items()})
    files[README] = readme_text(README.read_text())
    return files


def differing(files: dict[Path, str]) -> list[Path]:
    """The files that are not what ``files`` holds, and those it does not hold. A committed plot
    that another matplotlib made (the lock's for another Python) is held to exist only."""
    made = {p for p in PAGES.glob("*") if p.is_file()}
    stale = sorted(made - files.keys())
    return stale + [p for p, text in files.items()
                    if not p.exists() or (p.read_text() != text and not by_another_matplotlib(p))]


def by_another_matplotlib(path: Path) -> bool:
    """Whether ``path`` is a plot whose creator is not this matplotlib (``made_with``)."""
    return path.suffix == ".svg" and f"<dc:title>{made_with()}</dc:title>" not in path.read_text()


def write_all() -> list[Path]:
    files = expected()
    PAGES.mkdir(parents=True, exist_ok=True)
    for p in {q for q in PAGES.glob("*") if q.is_file()} - files.keys():
        p.unlink()
    changed = []
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


# --- adding a run's rows ---------------------------------------------------------------------

def commit_of_checkout() -> str:
    """This checkout's commit (7 digits), or "unknown" without git."""
    try:  # Popen, not run: tests stand in for subprocess.run to fake the lst-train runs a script makes
        with subprocess.Popen(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) as git:
            commit = git.communicate()[0].strip()
    except OSError:  # no git on this machine
        commit = ""
    return commit or "unknown"


def add_rows(benchmark: str, raw: Path, command: str, *, machine: str | None = None, torch_version: str | None = None,
             commit: str | None = None, date: str | None = None, data: Path | None = None) -> int:
    """Append the rows of a benchmark script's CSV to ``<data>/<benchmark>.csv`` (``benchmarks/results/``);
    returns how many. Columns the tidy CSV lacks are dropped; the meta columns come from the raw rows where
    they have them. A raw CSV without one of the tidy CSV's other columns, or with text in a numeric column,
    is refused (``ValueError``) and nothing is written."""
    target = (DATA if data is None else data) / f"{benchmark}.csv"
    with target.open(newline="") as fh:
        columns = next(csv.reader(fh))
    if machine is None or torch_version is None:
        import torch  # noqa: PLC0415

        from lst_lightning.app.machine import machine_name  # noqa: PLC0415

        machine = machine or machine_name()
        torch_version = torch_version or torch.__version__
    meta = {"machine": machine, "torch": torch_version, "commit": commit or commit_of_checkout(),
            "date": date or datetime.date.today().isoformat(), "command": command}
    with raw.open(newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [{**meta, **{k: v for k, v in r.items() if v != "" or k not in meta}} for r in reader]
        missing = [c for c in columns if c not in META and c not in (reader.fieldnames or ())]
    if missing:
        raise ValueError(f"{raw} has no column {', '.join(missing)} of {target.name}: not the run of {benchmark}'s "
                         f"script, or made by another version of it")
    for r in rows:
        for c in columns:
            if c not in TEXT and r.get(c) not in (None, ""):
                try:
                    float(r[c])  # a numeric column holds numbers only
                except ValueError:
                    raise ValueError(f"{raw}: column {c} holds {r[c]!r}, not a number") from None
    with target.open("a", newline="") as fh:
        csv.DictWriter(fh, columns, extrasaction="ignore", lineterminator="\n").writerows(rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action")
    add = sub.add_parser("add", help="append a run's rows to a benchmark's tidy CSV")
    add.add_argument("benchmark", choices=sorted(PAGES_BY_NAME))
    add.add_argument("raw", type=Path, help="the CSV the benchmark script wrote")
    add.add_argument("--command", required=True, help="the command that made it")
    add.add_argument("--machine", help="default: this machine's name")
    add.add_argument("--torch", help="default: this environment's torch")
    p.add_argument("--check", action="store_true", help="list the files that differ and exit 1 if any")
    args = p.parse_args(argv)
    if args.action == "add":
        try:
            n = add_rows(args.benchmark, args.raw, args.command, machine=args.machine, torch_version=args.torch)
        except (OSError, ValueError) as e:  # a missing or unreadable file, or rows that do not fit
            p.error(str(e))
        print(f"added {n} rows to benchmarks/results/{args.benchmark}.csv; now run scripts/results_pages.py")
        return 0
    if args.check:
        bad = differing(expected())
        for path in bad:
            print(f"differs: {path.relative_to(ROOT)}")
        return 1 if bad else 0
    for path in write_all():
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
