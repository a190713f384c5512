"""Time each Triton kernel of lst_kernels against its torch reference, side by side.

    uv run python scripts/bench_kernels.py [--smoke] [--out DIR | --update-results]

On a CUDA GPU: the paper's sizes (D = 793 471, d in {300, 512}, m in {128, 1024},
K = 1), median of CUDA-event timings after warm-up, the implementations of an op
timed in alternation, ratios printed, a CSV ``kernels_<gpu>.csv`` and a plot beside it
in a fresh run directory (``--update-results``: in benchmarks/results/). Every
implementation is checked against the reference before it is timed.

Besides the reference, some ops have a plain-torch competitor that a fused
kernel must beat to be worth keeping: ``torch_1gemm`` (M as one GEMM over
concatenated factors), ``torch_2gemm`` (the Q update as two GEMMs) and
``torch_atomic`` (scatter by ``index_add_``: fast but not deterministic).

Without a GPU it says so and exits 0. ``--smoke`` runs the whole pipeline at
tiny sizes on CPU in the Triton interpreter (timings meaningless) so that the
script can be tested without a GPU.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

# benchlib first: in a bare checkout (the GPU machine) it puts the kernels on the path.
from benchlib import (add_output_args, clock_for, interleaved_medians, machine_name, output_dir, pyplot,
                      save_figure, write_csv, wrote, zipf_targets)

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from lst_kernels import reference as ref  # noqa: E402
ISSUE_SIZES = dict(D=793_471, ds=(300, 512), ms=(128, 1024), K=1)
SMOKE_SIZES = dict(D=50, ds=(37,), ms=(6,), K=2)


# --- plain-torch competitors -------------------------------------------------

def m_matrix_1gemm(Hq, H, Z, gq, gs, ybar, num_classes, yy):
    """M = L R^T + Yd Yd^T with L = [a, Z, g_s, ybar], R = [a Q + Z, a, D g_s + ybar, g_s], a = 2 g_q H."""
    H = H.to(Z.dtype)
    a = 2 * gq[:, None] * H
    L = torch.cat([a, Z, gs[:, None], ybar[:, None]], dim=1)
    R = torch.cat([2 * gq[:, None] * Hq + Z, a, (num_classes * gs + ybar)[:, None], gs[:, None]], dim=1)
    return torch.addmm(yy, L, R.T)


def q_update_2gemm(Q, H, dH, M, lr, c):
    """Q_new = c^2 Q + [H; dH]^T [lr^2 M H - c lr dH; -c lr H]."""
    H, dH, M = H.to(Q.dtype), dH.to(Q.dtype), M.to(Q.dtype)
    P = torch.addmm(dH, M, H, beta=-c * lr, alpha=lr * lr)
    return torch.addmm(Q, torch.cat([H, dH]).T, torch.cat([P, (-c * lr) * H]), beta=c * c)


def scatter_atomic_(V, idx, G, X, alpha):
    """torch's index_add_ (float atomics on CUDA: order, and so bits, may vary)."""
    flat = idx.reshape(-1)
    keep = flat >= 0
    contrib = (G.reshape(-1, 1) * X.to(G.dtype).repeat_interleave(idx.shape[1], dim=0))[keep]
    return V.index_add_(0, flat[keep], (alpha * contrib).to(V.dtype))


def cases(D: int, d: int, m: int, K: int, device) -> dict[str, tuple[Callable, dict[str, Callable]]]:
    """op -> (make fresh args, {impl name: function})."""
    import lst_kernels as lk
    tri = {name: functools.partial(getattr(lk, name), impl="triton") for name in lk.__all__ if name != "reference"}

    V = torch.randn(D, d, device=device) * 0.01
    idx = zipf_targets((m, K), D, device=device)
    H = torch.randn(m, d, device=device).to(torch.bfloat16)  # the body's activations arrive in bf16
    G = torch.randn(m, K, device=device)
    x0 = torch.randn(m, device=device)
    Q = torch.randn(d, d, device=device)
    Q = Q + Q.T
    Hq = H.float() @ Q
    Z, dH = torch.randn(m, d, device=device), torch.randn(m, d, device=device)
    gq, gs, ybar = (torch.randn(m, device=device) for _ in range(3))
    yy = ref.sparse_gram(idx, G)
    M = ref.m_matrix(Hq, H, Z, gq, gs, ybar, D, yy)
    return {
        "gather_dot": (lambda: (V, idx, H, x0), {"reference": ref.gather_dot, "triton": tri["gather_dot"]}),
        "gather_sum": (lambda: (V, idx, G), {"reference": ref.gather_sum, "triton": tri["gather_sum"]}),
        # In place on V; small alpha keeps V sane over many repeats.
        "scatter_add_rows_": (lambda: (V, idx, G, H, 1e-6), {"reference": ref.scatter_add_rows_,
                                                               "triton": tri["scatter_add_rows_"],
                                                               "torch_atomic": scatter_atomic_}),
        "sparse_gram": (lambda: (idx, G), {"reference": ref.sparse_gram, "triton": tri["sparse_gram"]}),
        "m_matrix": (lambda: (Hq, H, Z, gq, gs, ybar, D, yy), {"reference": ref.m_matrix, "triton": tri["m_matrix"],
                                                                "torch_1gemm": m_matrix_1gemm}),
        "q_update": (lambda: (Q, H, dH, M, 0.01, 0.999), {"reference": ref.q_update, "triton": tri["q_update"],
                                                          "torch_2gemm": q_update_2gemm}),
    }


def check_against_reference(op: str, make_args, impls: dict[str, Callable]) -> None:
    if op == "scatter_add_rows_":
        V, *rest = make_args()
        expected = ref.scatter_add_rows_(V.clone(), *rest)
        outs = {name: fn(V.clone(), *rest) for name, fn in impls.items()}
    else:
        expected = getattr(ref, op)(*make_args())
        outs = {name: fn(*make_args()) for name, fn in impls.items()}
    for name, out in outs.items():
        scale = max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * scale, msg=lambda s: f"{op}/{name}: {s}")


def plot(rows: list[dict], path: Path, title: str) -> Path:
    configs = sorted({(r["m"], r["d"]) for r in rows})
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = pyplot().subplots(1, len(configs), figsize=(4.5 * len(configs), 4), squeeze=False, sharey=True)
    for ax, (m, d) in zip(axes[0], configs):
        sub = [r for r in rows if (r["m"], r["d"]) == (m, d) and r["impl"] != "reference"]
        impls = list(dict.fromkeys(r["impl"] for r in sub))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            xs = [ops.index(r["op"]) + i * width for r in sub if r["impl"] == impl]
            ys = [r["speedup_vs_reference"] for r in sub if r["impl"] == impl]
            ax.bar(xs, ys, width, label=impl)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ops))], ops, rotation=45, ha="right")
        ax.set_title(f"m={m}, d={d}")
    axes[0][0].set_ylabel("speed-up over the torch reference")
    axes[0][-1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in the Triton interpreter (tests only)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    add_output_args(p)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_kernels: the Triton kernels need a CUDA GPU; none here, nothing measured.")
        return 0
    sizes = SMOKE_SIZES if args.smoke else ISSUE_SIZES
    if args.smoke:
        args.warmup, args.iters = 1, 2
    device = "cuda" if cuda else "cpu"
    machine = machine_name()
    out = output_dir(args, "bench_kernels")
    rows: list[dict] = []
    for d in sizes["ds"]:
        for m in sizes["ms"]:
            torch.manual_seed(0)
            for op, (make_args, impls) in cases(sizes["D"], d, m, sizes["K"], device).items():
                check_against_reference(op, make_args, impls)
                args_now = make_args()
                calls = {name: (lambda fn=fn, a=args_now: fn(*a), 1) for name, fn in impls.items()}
                for call, _ in calls.values():
                    for _ in range(args.warmup):
                        call()
                times = {name: 1e3 * t for name, t in
                         interleaved_medians(calls, args.iters, warmup=0, clock=clock_for(device)).items()}
                for name, ms in times.items():
                    rows.append(dict(machine=machine, op=op, impl=name, D=sizes["D"], d=d, m=m, K=sizes["K"],
                                     median_ms=round(ms, 5), speedup_vs_reference=round(times["reference"] / ms, 3)))
                summary = "  ".join(f"{n} {ms:.4f} ms ({times['reference'] / ms:.2f}x)" for n, ms in times.items())
                print(f"m={m:5d} d={d:4d} {op:18s} {summary}", flush=True)
                del args_now, calls
            if cuda:
                torch.cuda.empty_cache()

    stem = out / f"kernels_{'smoke_' if args.smoke else ''}{machine}"
    wrote(write_csv(stem.with_suffix(".csv"), rows),
          plot(rows, stem.with_suffix(".png"), f"lst_kernels on {machine} (D={sizes['D']}, K={sizes['K']})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
