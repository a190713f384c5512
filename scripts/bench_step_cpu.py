"""The default head's training step beside the row-sparse sampled softmax's, on one CPU thread:
milliseconds a step and torch operator calls a step, side by side.

    uv run python scripts/bench_step_cpu.py [--D 100000 --d 128 --m 128] [--steps 200] [--profile] [--out DIR]

The default head is lst-train's (``loss="sampled"``, its negatives and right preconditioner at
their settings, ``sync_every=64``, ``step="fused"``), stepped by ``head.train_step(H, y)``; the
rival is ``SampledSoftmaxHead(sparse=True)`` with SGD on its row-sparse gradient. Operator calls
are counted two ways over one step: torch's profiler (every ATen call, those that other operators
make inside them included: "profiled") and a ``TorchDispatchMode`` (the calls the Python code makes,
views included: "dispatched").
``--profile``: cProfile's 25 costliest functions of the default step, by their own time.
Writes ``step_cpu.csv`` (a row a head: the machine, torch, commit, date, sizes, ms a step, the
operator calls, the ratio to the rival) into ``--out`` or a fresh run directory.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections import Counter

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import add_output_args, interleaved_medians, output_dir, provenance, wrote, write_csv, zipf_targets

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lst_lightning.heads import FactoredSphericalHead, SampledSoftmaxHead


class OpCounter(TorchDispatchMode):
    """Every ATen operator called under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def default_step(D: int, d: int):
    head = FactoredSphericalHead(num_classes=D, hidden_dim=d, loss="sampled", negatives={}, preconditioner={},
                                 sync_every=64, step="fused")
    return lambda H, y: head.train_step(H, y)


def sampled_softmax_step(D: int, d: int):
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sparse=True)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)

    def step(H, y):
        H = H.detach().requires_grad_()
        head(H, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def cycled(step, batches):
    """``step`` over the batches in turn, one a call."""
    state = {"i": 0}

    def one():
        state["i"] += 1
        step(*batches[state["i"] % len(batches)])
    return one


def counted(step, batch) -> tuple[int, Counter]:
    """(the profiler's ATen events, the dispatched operators by name) of one step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(*batch)
    with OpCounter() as c:
        step(*batch)
    return sum(e.name.startswith("aten::") for e in prof.events()), c.ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--D", type=int, default=100_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=0, help="also print the N most called operators of each step")
    p.add_argument("--profile", action="store_true", help="cProfile the default step")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.update_results:
        p.error("--update-results: this benchmark has no committed results; give --out")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.m, args.d, generator=g), zipf_targets(args.m, args.D, g)) for _ in range(8)]
    steps = {"default": default_step(args.D, args.d), "sampled_softmax": sampled_softmax_step(args.D, args.d)}
    print(f"D={args.D:,} d={args.d} m={args.m}, one thread, torch {torch.__version__}")
    # timed in alternation, 5 steps each a round: a load that comes and goes falls on both alike
    medians = interleaved_medians({k: (cycled(v, batches), 5) for k, v in steps.items()}, args.steps // 5, warmup=10)
    out, rows = output_dir(args, "bench_step_cpu"), []
    facts = {**provenance(), "D": args.D, "d": args.d, "m": args.m, "threads": 1}
    for name, step in steps.items():
        ms = 1e3 * medians[name]
        profiled, ops = counted(step, batches[0])
        print(f"{name:>16}: {ms:7.2f} ms/step  {profiled:5d} op calls/step profiled, "
              f"{sum(ops.values()):4d} dispatched")
        if args.top:
            print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top)))
        rows.append({**facts, "head": name, "ms_per_step": round(ms, 4), "ops_profiled": profiled,
                     "ops_dispatched": sum(ops.values()),
                     "over_sampled_softmax": round(medians[name] / medians["sampled_softmax"], 4)})
    print(f"default / sampled_softmax: {medians['default'] / medians['sampled_softmax']:.2f}x")
    wrote(write_csv(out / "step_cpu.csv", rows))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(50):
            steps["default"](*batches[i % len(batches)])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
