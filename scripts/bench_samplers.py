"""Kernel-based negative sampling: the sum-tree (O(F log n) per draw) against the direct
way (all n kernel values, O(n F) per row, then a multinomial draw), over n, on CPU.

Prints the ratios measured side by side in one run, writes
bench_samplers_<kernel>_<machine>.csv and a plot beside it into a fresh run directory
(``--out DIR``; ``--update-results``: into benchmarks/results/).

    uv run python scripts/bench_samplers.py [--kernel rff|quadratic] [--sizes 1000 4000 ...]
"""
from __future__ import annotations

import argparse

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import (positive_int, add_output_args, interleaved_medians, machine_name, output_dir, pyplot, save_figure,
                      write_csv, wrote)

import torch
from rich.console import Console
from rich.table import Table

from lst_lightning.baselines.samplers import KernelSumTree
from lst_lightning.heads.kernel_functions import QuadraticKernel, RandomFourierKernel


def build_ms(tree, C, reps: int) -> float:
    return 1e3 * interleaved_medians({"build": (lambda: tree.build(C), 1)}, rounds=reps, warmup=0)["build"]


def direct_draw(kernel, state, h, num_samples):
    """The direct way: every class's kernel value, clamped, then a multinomial draw."""
    vals = kernel.leaf_values(kernel.query(h), h, state).clamp(min=0)
    return torch.multinomial(vals, num_samples, replacement=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=["rff", "quadratic"], default="rff")
    ap.add_argument("--sizes", type=positive_int, nargs="+", default=[1000, 4000, 16000, 64000, 256000])
    ap.add_argument("--hidden-dim", type=positive_int, default=32)
    ap.add_argument("--d-rff", type=positive_int, default=128)
    ap.add_argument("--rows", type=positive_int, default=16, help="hidden rows m per call")
    ap.add_argument("--samples", type=positive_int, default=64, help="draws S per row")
    ap.add_argument("--leaf-size", type=positive_int, default=16)
    ap.add_argument("--reps", type=positive_int, default=5)
    ap.add_argument("--threads", type=positive_int, default=1)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out = output_dir(args, "bench_samplers")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    d, m, S = args.hidden_dim, args.rows, args.samples
    if args.kernel == "rff":
        kernel = RandomFourierKernel(d, args.d_rff, nu=4.0)
    else:
        kernel = QuadraticKernel(d, alpha=100.0)
    machine = machine_name()
    rows = []
    for n in args.sizes:
        C = torch.randn(n, d)
        h = torch.randn(m, d)
        tree = KernelSumTree(kernel, args.leaf_size)
        tree_build_ms = build_ms(tree, C, max(1, args.reps // 2))
        state = tree.state[:n]
        # Keeping the tree in step after a step that trained the m S negatives and m targets.
        upd = torch.randint(0, n, (m * (S + 1),))
        # In alternation, so passing load on the shared machine falls on all alike.
        t = interleaved_medians({"direct": (lambda: direct_draw(kernel, state, h, S), 1),
                                 "tree": (lambda: tree.sample(h, S), 1),
                                 "update": (lambda: tree.update(upd, C[upd]), 1)}, rounds=args.reps, warmup=1)
        direct_ms, tree_ms, update_ms = (1e3 * t[k] for k in ("direct", "tree", "update"))
        rows.append({"kernel": args.kernel, "n": n, "d": d,
                     "feature_dim": kernel.feature_dim, "rows": m, "samples": S, "leaf_size": args.leaf_size,
                     "threads": args.threads, "direct_ms": round(direct_ms, 3), "tree_ms": round(tree_ms, 3),
                     "direct_over_tree": round(direct_ms / tree_ms, 3), "tree_update_ms": round(update_ms, 3),
                     "tree_build_ms": round(tree_build_ms, 3)})
    table = Table(title=f"{args.kernel} sampling, {m} rows x {S} draws, F = {kernel.feature_dim}, {machine}, "
                        f"{args.threads} thread(s)")
    for col in ("n", "direct_ms", "tree_ms", "direct_over_tree", "tree_update_ms", "tree_build_ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(str(r[c]) for c in ("n", "direct_ms", "tree_ms", "direct_over_tree", "tree_update_ms",
                                            "tree_build_ms")))
    Console().print(table)

    stem = out / f"bench_samplers_{args.kernel}_{machine}"
    fig, ax = pyplot().subplots(figsize=(6, 4))
    ns = [r["n"] for r in rows]
    ax.loglog(ns, [r["direct_ms"] for r in rows], "o-", label="direct: all n kernel values + multinomial")
    ax.loglog(ns, [r["tree_ms"] for r in rows], "s-", label="sum-tree walk")
    ax.loglog(ns, [r["tree_update_ms"] for r in rows], "^--", label=f"tree update of {m * (S + 1)} rows")
    ax.set_xlabel("number of classes n")
    ax.set_ylabel(f"ms per call ({m} rows x {S} draws)")
    ax.set_title(f"{args.kernel} sampler, F = {kernel.feature_dim}, {machine}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    wrote(write_csv(stem.with_suffix(".csv"), rows, machine=machine), save_figure(fig, stem.with_suffix(".png")))


if __name__ == "__main__":
    main()
