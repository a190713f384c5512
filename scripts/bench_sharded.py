"""The vocabulary-sharded factored head over N processes (gloo on CPU, NCCL on GPUs):
step time, V memory per rank and bytes exchanged per step, against one process.

    uv run python scripts/bench_sharded.py --D 10000000 --d 128 --m 256 --world 2

One process per rank (rank r holds V's rows of classes [r D/N, (r+1) D/N)); every
rank runs the same global batches. Prints the ratios measured in this run and adds
its rows to bench_sharded_<machine>.csv in a fresh run directory (``--out DIR``: that
folder's file; ``--update-results``: benchmarks/results/'s).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import positive_int, add_output_args, machine_name, output_dir, write_csv, wrote, zipf_targets

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lst_lightning.heads import FactoredSphericalHead


def comm_bytes(M: int, d: int, K: int, itemsize: int, sharded: bool) -> int:
    """Bytes each rank receives per training step: H, ids and target values of the global
    batch, and when sharded the all-reduced gather-dot (M K) and gather-sum (M d)."""
    b = M * d * itemsize + M * K * 8 + M * K * itemsize
    return b + (M * K + M * d) * itemsize if sharded else b


def run(rank: int, world: int, rdv: str, args, out: str) -> None:
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    t0 = time.perf_counter()
    head = FactoredSphericalHead(num_classes=args.D, hidden_dim=args.d, loss="zloss", lr=0.01, bias=True,
                                 generator=torch.Generator().manual_seed(0), parallel="sharded",
                                 stabiliser={"q_refresh_every": 0})
    head.distribute()
    setup_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    M = args.m * world
    batches = [(torch.randn(M, args.d, generator=g), zipf_targets(M, args.D, g)) for _ in range(4)]
    rows = slice(rank * args.m, (rank + 1) * args.m)
    times = []
    for i in range(args.warmup + args.steps):
        H, idx = batches[i % len(batches)]
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        head(H[rows].clone().requires_grad_(), idx[rows]).backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    res = {"rank": rank, "world": world, "median_ms": 1e3 * statistics.median(times), "setup_s": setup_s,
           "v_rows": head.V.shape[0], "v_gb": head.V.numel() * head.V.element_size() / 1e9}
    torch.save(res, os.path.join(out, f"{world}_{rank}.pt"))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        if world == 1:
            run(0, 1, "", args, tmp)
        else:
            mp.spawn(run, args=(world, os.path.join(tmp, "rdv"), args, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"{world}_{r}.pt")) for r in range(world)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=positive_int, default=10_000_000)
    p.add_argument("--d", type=positive_int, default=128)
    p.add_argument("--m", type=positive_int, default=256, help="rows per rank")
    p.add_argument("--world", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--single", action="store_true", help="also time one process on the global batch")
    add_output_args(p)
    args = p.parse_args(argv)
    out = output_dir(args, "bench_sharded")
    rows = []
    for world in ([1] if args.single else []) + [args.world]:
        res = measure(world, args)
        step = max(r["median_ms"] for r in res)
        M = args.m * world
        rows.append({"D": args.D, "d": args.d, "m_per_rank": args.m, "world": world,
                     "global_batch": M, "step_ms": round(step, 3),
                     "v_gb_per_rank": round(max(r["v_gb"] for r in res), 3),
                     "comm_mb_per_step": round(comm_bytes(M, args.d + 1, 1, 4, True) / 1e6, 3) if world > 1 else 0.0,
                     "setup_s": round(max(r["setup_s"] for r in res), 1)})
        print(rows[-1])
    if args.single:
        print(f"step time, {args.world} ranks (global batch {args.m * args.world}) / one process (global batch "
              f"{args.m}): {rows[1]['step_ms'] / rows[0]['step_ms']:.2f}; V per rank "
              f"{rows[1]['v_gb_per_rank']} GB vs {rows[0]['v_gb_per_rank']} GB")
    # Appended: the file collects the sizes measured so far.
    wrote(write_csv(out / f"bench_sharded_{machine_name()}.csv", rows, append=True))


if __name__ == "__main__":
    main()
