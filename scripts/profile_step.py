"""Where the factored head's step spends its time: torch's profiler over a few steps of each of
bench_heads.py's factored paths (the autograd step, ``train_step`` with no host reads, and that
step replayed from a CUDA graph), at the step target's size by default.

    python3 scripts/profile_step.py --out DIR [--D 793471 --d 512 --m 1024] [--inverse products,solve] [--smoke]

For each path it prints, and writes to ``profile_step_<machine>.txt`` in DIR: the wall time of a
step (CUDA events, median of 20), the device time its kernels take (their sum, per step), the
kernels launched per step, and the 20 operators that hold the device longest. Wall far above
device time is the host's part (launches, syncs); device time is what a graph or fusion leaves.
``--inverse`` profiles each path once per route to H U_new^-1 (``Stabiliser.inverse``:
auto, woodbury, solve, products), side by side. ``--factors 2,6`` profiles the steps that read
their checks as device flags (``factored_sync``, ``factored_graph``) once per number of Neumann
factors on the products route, pinned (a read of the flags keeps them), in place of their
unpinned runs: what
``Stabiliser.neumann="adaptive"`` saves where a trained model's rho asks for 2, timed side by
side (the random inputs here would keep 6 under either rule; a step whose residual check then
fails is masked, its kernels run all the same). ``--smoke`` runs it on the CPU at a tiny size
(the CUDA graph skipped): tests.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import cuda_clock, machine_name, perf_clock

import torch
from torch.profiler import ProfilerActivity, profile

from bench_heads import TARGET, HeadSpec, build, make_batches
from lst_lightning.spherical.inverse_update import MAX_FACTORS
from lst_lightning.spherical.stabiliser import INVERSE_ROUTES, Repairs, Stabiliser

PATHS = ("factored", "factored_sync", "factored_graph")


def pin_factors(head, factors: int) -> None:
    """Hold the products route's Neumann factors at ``factors`` whatever the flags read (timing only)."""
    checks = head.step_checks
    checks.factors = factors
    checks.adapt_factors = lambda *args: None  # this object's reads keep them


def profile_path(name: str, D: int, d: int, m: int, device: torch.device, steps: int, inverse: str,
                 loss: str = "zloss", factors: int | None = None) -> str:
    spec = HeadSpec(name, loss, self_updating=True, cuda_only=name == "factored_graph")
    if spec.cuda_only and device.type != "cuda":
        return f"== {name}: skipped (CUDA only)\n"
    head, make = build(spec, D, d, torch.float32, device)
    head.repairs = Repairs(Stabiliser(inverse=inverse))  # before its first step (and a graph's capture)
    if factors is not None:
        pin_factors(head, factors)
    try:
        step = make(make_batches(D, d, m, torch.float32, device))
    except ValueError as exc:  # a mode the head refuses (negatives in a CUDA graph): said, not profiled
        return f"== {spec.head}, loss={loss}: refused: {exc}\n"
    clock = cuda_clock if device.type == "cuda" else perf_clock
    for _ in range(5):
        step()
    wall_ms = statistics.median(1e3 * clock(step) for _ in range(steps))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    device_ms = sum(e.device_time for e in kernels) / 1e3 / steps
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    table = events.table(sort_by=sort, row_limit=20, max_name_column_width=60)
    stats = {k: v for k, v in head.stats().items() if v}  # the repairs' counters after every step run
    pinned = "" if factors is None else f", factors={factors}"
    return (f"== {spec.head}, loss={loss}, inverse={inverse}{pinned}: D={D:,} d={d} m={m}: wall {wall_ms:.3f} ms/step, kernels {device_ms:.3f} ms/step, "
            f"{len(kernels) / steps:.0f} kernels/step\n{2 * steps + 5} steps, {stats}\n{table}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--D", type=int, default=TARGET["D"])
    p.add_argument("--d", type=int, default=TARGET["d"])
    p.add_argument("--m", type=int, default=TARGET["m"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--loss", default="zloss", help="the factored head's loss (sampled: its negatives at their defaults)")
    p.add_argument("--inverse", default="auto", help=f"comma-separated routes to H U_new^-1: {','.join(INVERSE_ROUTES)}")
    p.add_argument("--factors", default="", help="comma-separated Neumann factors to pin, each profiled on the "
                   "products route for the device-flag paths (factored_sync, factored_graph)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.D, args.d, args.m, args.steps = 300, 16, 8, 3
    tf32 = torch.backends.cuda.matmul.allow_tf32
    text = f"{machine_name()}, torch {torch.__version__}, allow_tf32={tf32}\n"
    print(text, flush=True)
    routes = [r.strip() for r in args.inverse.split(",") if r.strip()]
    if not routes or set(routes) - set(INVERSE_ROUTES):
        p.error(f"--inverse takes routes from {list(INVERSE_ROUTES)}, got {args.inverse!r}")
    try:
        pinned = [int(k) for k in args.factors.split(",") if k.strip()]
    except ValueError:
        pinned = [0]
    if any(not 1 <= k <= MAX_FACTORS for k in pinned):
        p.error(f"--factors takes numbers of Neumann factors from 1 to {MAX_FACTORS}, got {args.factors!r}")
    # with --factors the device-flag paths run pinned only (unpinned, they take MAX_FACTORS: a pinned run)
    runs = [(head, route, None) for head in PATHS if not pinned or head == "factored" for route in routes]
    runs += [(head, "products", k) for head in PATHS if head != "factored" for k in pinned]
    for head, route, factors in runs:
        part = profile_path(head, args.D, args.d, args.m, device, args.steps, route, args.loss, factors)
        print(part, flush=True)
        text += part
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_step_{machine_name()}.txt"
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
