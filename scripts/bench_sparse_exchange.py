"""Row-sparse gradients averaged over N gloo processes by all-gathers (app/sparse_exchange.py):
bytes each rank receives per step and time per exchange, for sparse tables of D rows,
against the D x d gradient a dense all-reduce would carry.

    uv run python scripts/bench_sparse_exchange.py --D 10000 1000000 --d 128 --m 256 --context 4

Each rank looks up m x context ids of an ``nn.Embedding(D, d, sparse=True)``, drawn from
the synthetic task's Zipf law over the first ``--ids`` rows (the same ids for every D, so
the rows touched are equal and any change with D would be the exchange's own), backward,
then the exchange. ``--gradient``: ``coo`` (torch's sparse gradient: its distinct rows, their
count read on the host) and ``static`` (static rows, ``optimizer.embedding=row_adam``: every
lookup's row, in fixed shapes, no host read). Adds its rows to bench_sparse_exchange_<machine>.csv in a fresh run
directory (``--out DIR``: that folder's; ``--update-results``: benchmarks/results/'s).
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
from torch import nn

from lst_lightning.app.sparse_exchange import average_sparse_gradients
from lst_lightning.rows import static_rows


def run(rank: int, world: int, rdv: str, args, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    res = {}
    for gradient in args.gradient:
        for D in args.D:
            model = nn.Sequential(nn.Embedding(D, args.d, sparse=True))
            if gradient == "static":
                static_rows(model)  # a RowEmbedding on the same weight
            emb = model[0]
            ids = zipf_targets((args.m, args.context), min(args.ids, D), torch.Generator().manual_seed(1 + rank))
            times, received = [], 0
            for i in range(args.warmup + args.steps):
                emb.zero_grad(set_to_none=True)
                if gradient == "static":
                    emb.row_grad.zero_grad()
                emb(ids).sum().backward()
                dist.barrier()
                t = time.perf_counter()
                received = average_sparse_gradients([emb.weight], step=i)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
            res[gradient, D] = {"bytes": received, "ms": 1e3 * statistics.median(times),
                                "rows": int(ids.unique().numel())}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(args) -> list[dict]:
    """Each rank's {(gradient, D): bytes received, median ms, distinct rows}."""
    with tempfile.TemporaryDirectory() as tmp:
        # forked from a fresh server (torch imported once there), never from this process: a fork
        # of a process whose autograd has started its threads fails at its first backward
        mp.start_processes(run, args=(args.world, os.path.join(tmp, "rdv"), args, tmp), nprocs=args.world,
                           start_method="forkserver")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(args.world)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=positive_int, nargs="+", default=[10_000, 1_000_000], help="rows of the sparse table")
    p.add_argument("--d", type=positive_int, default=128)
    p.add_argument("--m", type=positive_int, default=256, help="examples per rank")
    p.add_argument("--context", type=positive_int, default=4, help="ids per example")
    p.add_argument("--ids", type=positive_int, default=10_000, help="the ids are drawn from the first IDS rows")
    p.add_argument("--gradient", nargs="+", choices=["coo", "static"], default=["coo", "static"],
                   help="torch's sparse COO gradient, or static rows (row_adam's)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=positive_int, default=1)
    add_output_args(p)
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be at least 2: one process exchanges nothing")
    out = output_dir(args, "bench_sparse_exchange")
    ranks = measure(args)
    rows = []
    for key in ((g, D) for g in args.gradient for D in args.D):
        rows.append({"gradient": key[0], "D": key[1], "d": args.d, "m_per_rank": args.m, "context": args.context,
                     "world": args.world, "rows_touched_max": max(r[key]["rows"] for r in ranks),
                     "bytes_per_step": max(r[key]["bytes"] for r in ranks),
                     "exchange_ms": round(max(r[key]["ms"] for r in ranks), 3),
                     "dense_grad_bytes": key[1] * args.d * 4})
        print(rows[-1])
    wrote(write_csv(out / f"bench_sparse_exchange_{machine_name()}.csv", rows, append=True))


if __name__ == "__main__":
    main()
