"""Step-time benchmark of the factored head against the explicit-W ways of training
the same output layer, measured side by side in one run, on CPU.

    uv run python scripts/bench_head_cpu.py           # small sizes, about a minute on 2 cores
    uv run python scripts/bench_head_cpu.py --full    # the paper's size and D up to 2 x 10^6 (~8 GB)

``--full``: the factored step against torch's chunked F.linear_cross_entropy
(D = 500 000, d = 256, m = 256), against the naive explicit-W head (the paper's CPU
size, D = 793 471, d = 300, m = 128), and the factored step over D = 20 000 ... 2 000 000.
Writes a CSV and a plot named after the machine into a fresh run directory
(``--out DIR``; ``--update-results``: into benchmarks/results/).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import (positive_int, add_output_args, interleaved_medians, machine_name, output_dir, pyplot, save_figure,
                      wrote, write_csv, zipf_targets)

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from lst_lightning.heads import FactoredSphericalHead, NaiveSphericalHead


def _batches(m: int, d: int, D: int, n: int = 8):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(m, d, generator=g), zipf_targets(m, D, g)) for _ in range(n)]
    state = {"i": 0}

    def next_batch():
        state["i"] = (state["i"] + 1) % n
        return data[state["i"]]
    return next_batch


def head_step(head, m: int) -> Callable[[], None]:
    """One training step of a self-updating head (its update runs inside backward)."""
    next_batch = _batches(m, head.hidden_dim, head.num_classes)

    def step():
        H, y = next_batch()
        H = H.clone().requires_grad_()
        head(H, y).backward()
    return step


def linear_cross_entropy_step(D: int, d: int, m: int, lr: float = 0.01) -> Callable[[], None]:
    """torch's chunked F.linear_cross_entropy: forward, backward and an SGD step on W.

    Chunks of rows holding 2^24 logits, as SoftmaxHead: torch's "auto" choice ran
    20-40x slower than the unchunked call on CPU (measured), a baseline too easy to beat."""
    W = (torch.randn(D, d) * d ** -0.5).requires_grad_()
    next_batch = _batches(m, d, D)
    rows = max(1, min(m, (1 << 24) // D))
    options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=rows)

    def step():
        H, y = next_batch()
        H = H.clone().requires_grad_()
        F.linear_cross_entropy(H, W, y, options=options).backward()
        with torch.no_grad():
            W.sub_(lr * W.grad)
        W.grad = None
    return step


def make_step(impl: str, D: int, d: int, m: int) -> Callable[[], None]:
    if impl == "factored":
        return head_step(FactoredSphericalHead(num_classes=D, hidden_dim=d, loss="zloss", lr=0.01, bias=False), m)
    if impl == "naive":
        return head_step(NaiveSphericalHead(num_classes=D, hidden_dim=d, loss="zloss", lr=0.01, bias=False), m)
    if impl == "linear_cross_entropy":
        return linear_cross_entropy_step(D, d, m)
    raise ValueError(f"unknown implementation {impl!r}")


def missing(impl: str) -> str | None:
    """Why this torch cannot run ``impl``, or None."""
    if impl == "linear_cross_entropy" and not hasattr(F, "linear_cross_entropy"):
        return f"F.linear_cross_entropy is new in torch 2.13, this is torch {torch.__version__}"
    return None


def run(configs: list[dict], reps: int, console: Console) -> list[dict]:
    """Time each group's implementations (or each size of a group) in alternation; one this
    torch lacks is left out, and said so."""
    rows = []
    for impl in dict.fromkeys(i for c in configs for i in c["impls"]):
        if missing(impl):
            console.print(f"[yellow]{impl} left out: {missing(impl)}[/yellow]")
    for group in dict.fromkeys(c["group"] for c in configs):
        members = [(c, impl) for c in configs if c["group"] == group for impl in c["impls"] if not missing(impl)]
        steps, keys = {}, []
        for cfg, impl in members:
            console.print(f"[dim]building {impl} at D={cfg['D']:,} d={cfg['d']} m={cfg['m']}[/dim]")
            key = f"{impl}@{cfg['D']}"
            # The explicit-W steps take seconds: one per round; the factored step: many.
            inner = reps if impl == "factored" else 1
            steps[key] = (make_step(impl, cfg["D"], cfg["d"], cfg["m"]), inner)
            keys.append((key, cfg, impl))
        slow = any(impl != "factored" for _, impl in members)
        console.print(f"[dim]timing {group} in alternation[/dim]")
        med = interleaved_medians(steps, rounds=3 if slow else 5, warmup=1 if slow else 3)
        for key, cfg, impl in keys:
            rows.append({"group": group, "impl": impl, "D": cfg["D"], "d": cfg["d"], "m": cfg["m"],
                         "ms": 1e3 * med[key]})
        del steps
    return rows


# The groups of each size: the implementations of a group are timed in alternation.
CONFIGS = {
    "full": [
        {"group": "vs_linear_cross_entropy", "D": 500_000, "d": 256, "m": 256,
         "impls": ["factored", "linear_cross_entropy"], "target": 250},
        {"group": "vs_naive_paper_cpu", "D": 793_471, "d": 300, "m": 128,
         "impls": ["factored", "naive"], "target": 300},
        {"group": "flat_in_D", "D": 20_000, "d": 256, "m": 256, "impls": ["factored"]},
        {"group": "flat_in_D", "D": 200_000, "d": 256, "m": 256, "impls": ["factored"]},
        {"group": "flat_in_D", "D": 2_000_000, "d": 256, "m": 256, "impls": ["factored"]},
    ],
    "quick": [
        {"group": "vs_linear_cross_entropy", "D": 100_000, "d": 128, "m": 128,
         "impls": ["factored", "linear_cross_entropy"]},
        {"group": "vs_naive", "D": 100_000, "d": 128, "m": 128, "impls": ["factored", "naive"]},
        {"group": "flat_in_D", "D": 10_000, "d": 128, "m": 128, "impls": ["factored"]},
        {"group": "flat_in_D", "D": 1_000_000, "d": 128, "m": 128, "impls": ["factored"]},
    ],
    "smoke": [  # every group and implementation at tiny sizes (tests)
        {"group": "vs_linear_cross_entropy", "D": 300, "d": 16, "m": 8, "impls": ["factored", "linear_cross_entropy"]},
        {"group": "vs_naive", "D": 300, "d": 16, "m": 8, "impls": ["factored", "naive"]},
        {"group": "flat_in_D", "D": 100, "d": 16, "m": 8, "impls": ["factored"]},
        {"group": "flat_in_D", "D": 1000, "d": 16, "m": 8, "impls": ["factored"]},
    ],
}


def ratios(rows: list[dict], cfgs: list[dict]) -> list[dict]:
    """Speed-ups of the factored step, within each group, measured in this run."""
    out = []
    for cfg in cfgs:
        same = [r for r in rows if r["group"] == cfg["group"] and r["D"] == cfg["D"]]
        fac = next(r for r in same if r["impl"] == "factored")
        for r in same:
            if r["impl"] != "factored":
                out.append({"what": f"factored vs {r['impl']} (D={r['D']:,}, d={r['d']}, m={r['m']})",
                            "ratio": r["ms"] / fac["ms"], "target": cfg.get("target")})
    flat = sorted((r for r in rows if r["group"] == "flat_in_D"), key=lambda r: r["D"])
    if len(flat) >= 2:
        lo, hi = flat[0], flat[-1]
        out.append({"what": f"factored step at D={hi['D']:,} / at D={lo['D']:,}",
                    "ratio": hi["ms"] / lo["ms"], "target": 1.15 if hi["D"] >= 2_000_000 else None,
                    "at_most": True})
    return out


def plot(rows: list[dict], path: Path, machine: str) -> Path:
    fig, ax = pyplot().subplots(figsize=(6.5, 4.2))
    markers = {"factored": "o", "naive": "s", "linear_cross_entropy": "^"}
    for impl, d, m in dict.fromkeys((r["impl"], r["d"], r["m"]) for r in rows):
        pts = sorted((r["D"], r["ms"]) for r in rows if (r["impl"], r["d"], r["m"]) == (impl, d, m))
        if pts:
            ax.plot(*zip(*pts), marker=markers.get(impl, "x"), label=f"{impl} (d={d}, m={m})")
            for D, ms in pts:
                ax.annotate(f"{ms:.3g}", (D, ms), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("classes D")
    ax.set_ylabel("training step (ms)")
    ax.set_title(f"Output-layer step time, {machine}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the paper's and the issue's sizes (minutes, ~8 GB)")
    size.add_argument("--smoke", action="store_true", help="every comparison at tiny sizes in seconds (tests)")
    p.add_argument("--reps", type=positive_int, default=10, help="factored steps per round (3 or 5 rounds; median)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1, as every benchmark script: steadier on a shared machine)")
    add_output_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kind = "full" if args.full else "smoke" if args.smoke else "quick"
    out = output_dir(args, "bench_head_cpu")
    console = Console()
    machine = machine_name()
    torch.manual_seed(0)
    cfgs = CONFIGS[kind]
    rows = run(cfgs, reps=2 if args.smoke else args.reps, console=console)

    table = Table(title=f"Output-layer training step (forward + backward + update), {machine}, "
                        f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for col in ("group", "impl", "D", "d", "m", "ms / step"):
        table.add_column(col, justify="right" if col in ("D", "d", "m", "ms / step") else "left")
    for r in rows:
        table.add_row(r["group"], r["impl"], f"{r['D']:,}", str(r["d"]), str(r["m"]), f"{r['ms']:.3f}")
    console.print(table)
    rt = Table(title="Ratios measured in this run")
    for col in ("comparison", "ratio", "target"):
        rt.add_column(col)
    for r in ratios(rows, cfgs):
        tgt = "" if r["target"] is None else (f"<= {r['target']}" if r.get("at_most") else f">= {r['target']}x")
        ok = "" if r["target"] is None else (
            " [green]met[/green]" if (r["ratio"] <= r["target"] if r.get("at_most") else r["ratio"] >= r["target"])
            else " [red]missed[/red]")
        rt.add_row(r["what"], f"{r['ratio']:.2f}" + ("" if r.get("at_most") else "x"), tgt + ok)
    console.print(rt)
    stem = out / f"head_cpu_{kind}_{machine}"
    common = {"run": kind, "threads": torch.get_num_threads()}  # run: the results page's full and quick rows
    wrote(write_csv(stem.with_suffix(".csv"), [{**common, **r} for r in rows], machine=machine),
          plot(rows, stem.with_suffix(".png"), machine))


if __name__ == "__main__":
    main()
