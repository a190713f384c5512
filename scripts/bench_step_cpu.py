"""The default head's training step beside the row-sparse sampled softmax's, on one CPU thread:
milliseconds a step and torch operator calls a step, side by side.

    uv run python scripts/bench_step_cpu.py [--D 100000 --d 128 --m 128] [--steps 200] [--profile] [--out DIR]
    uv run python scripts/bench_step_cpu.py --compile     # each step eager and compiled, side by side

The default head is lst-train's (``loss="sampled"``, its negatives and right preconditioner at
their settings, ``sync_every=64``), stepped by ``head.train_step(H, y)`` (``step="fused"``: the
whole step in one call, lst-train's choice on one CPU process); the
rival is ``SampledSoftmaxHead(sparse=True)`` with SGD on its row-sparse gradient. Operator calls
are counted two ways over one step: torch's profiler (every ATen call, those that other operators
make inside them included: "profiled") and a ``TorchDispatchMode`` (the calls the Python code makes,
views included: "dispatched").
``--profile``: cProfile's 25 costliest functions of the default step, by their own time.
``--clock cpu``: each step timed on this process's CPU time, not the wall (on a shared machine).

``--compile``: each step also compiled by Inductor (C++ on the CPU), as its best practitioner
would compile it, and the rival as lst-train trains it too:

- ``default+compiled``: the same head with ``compile_step=True`` (its own compiled step);
- ``sampled_softmax+compiled``: static rows (``lst_lightning.rows``: its class rows' gradient
  as the batch's (ids, rows), which torch.compile takes whole; torch's sparse COO gradient does
  not compile), its forward and backward compiled whole (``fullgraph``, static shapes, after one
  eager step, as lst-train's ``compile=true``), and the same SGD as a compiled ``index_add_``
  of those rows;
- ``sampled_softmax_adam`` and its ``+compiled``: the rival with lst-train's optimiser of its
  rows, torch's ``SparseAdam`` eager (``optimizer.embedding=auto`` eager on a CPU) and
  ``RowAdam`` compiled (its choice where the run compiles), SparseAdam's arithmetic both.

Inductor's caches are off and its C++ compiles run in this process
(``force_disable_caches``, ``compile_threads=1``): ``compile_s`` is the CPU time of a cold
compile (the first 3 steps, less 3 steps at the compiled speed). Operator calls are counted for
the eager steps only. The rows' ``over_rival_best``: ms a step over the fastest of the rival's
forms with the same optimiser (eager or compiled; SGD for the default, whose own update is SGD).
Writes ``step_cpu.csv`` (a row a step: the machine, torch, commit, date, sizes, ms a step, the
compile time, the operator calls, the ratios to the rival) into ``--out`` or a fresh run directory.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import Counter

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import (add_output_args, interleaved_medians, output_dir, perf_clock, provenance, write_csv, wrote,
                      zipf_targets)

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lst_lightning.heads import FactoredSphericalHead, SampledSoftmaxHead
from lst_lightning.rows import RowAdam, row_grad_of, static_rows

#: steps run before timing a compiled step: its first (eager where it sizes static rows) and compiles
COMPILE_CALLS = 3


class OpCounter(TorchDispatchMode):
    """Every ATen operator called under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def default_step(D: int, d: int, compiled: bool = False):
    head = FactoredSphericalHead(num_classes=D, hidden_dim=d, loss="sampled", negatives={}, preconditioner={},
                                 sync_every=64, step="fused", compile_step=compiled)
    if head.compiles != compiled:
        raise RuntimeError(f"the default head's step compiles: {head.compiles}, asked {compiled}")
    return lambda H, y: head.train_step(H, y)


LR = 0.1


def sampled_softmax_step(D: int, d: int, optimizer: str = "sgd"):
    """The rival eager: its row-sparse (COO) gradient stepped by torch's SGD or SparseAdam."""
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sparse=True)
    opt = (torch.optim.SGD(head.parameters(), lr=LR) if optimizer == "sgd" else
           torch.optim.SparseAdam(list(head.parameters()), lr=LR))

    def step(H, y):
        H = H.detach().requires_grad_()
        head(H, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _row_sgd_(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, lr: float) -> None:
    """SGD on the rows ``ids`` of ``table`` (repeats summed, -1 ignored), as SGD on the COO gradient."""
    keep = (ids >= 0).view(-1, *[1] * (rows.dim() - 1))
    table.index_add_(0, ids.clamp(min=0), torch.where(keep, rows, 0) * -lr)


def sampled_softmax_compiled_step(D: int, d: int, optimizer: str = "sgd"):
    """The rival compiled as lst-train's ``compile=true`` compiles it: static rows, the forward (and
    so its backward) compiled whole from the second step, the rows stepped by a compiled update
    (SGD: ``_row_sgd_``; adam: ``RowAdam(compiled=True)``, lst-train's)."""
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sparse=True)
    tables = head.sparse_parameters()
    if {id(p) for p in head.parameters()} != {id(p) for p in tables}:
        raise RuntimeError("the sampled softmax has parameters other than its row-sparse tables")
    static_rows(head, tables)
    forward = torch.compile(head.forward, fullgraph=True, dynamic=False)
    update = torch.compile(_row_sgd_, fullgraph=True, dynamic=False)
    adam = RowAdam(tables, lr=LR, compiled=True) if optimizer == "adam" else None
    calls = [0]

    def step(H, y):
        H = H.detach().requires_grad_()
        calls[0] += 1
        (head.forward if calls[0] == 1 else forward)(H, y).backward()  # the first eager: it sizes the rows
        if adam is not None:
            adam.step()
            adam.zero_grad()
            return
        with torch.no_grad():
            for t in tables:
                update(t, *row_grad_of(t).grad(), LR)
                row_grad_of(t).zero_grad()
    return step


def cpu_clock(fn) -> float:
    """CPU seconds of this process that one call of ``fn`` takes (what another job's load leaves out)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=int, default=100_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=0, help="also print the N most called operators of each step")
    p.add_argument("--profile", action="store_true", help="cProfile the default step")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time a step on the wall clock or on this process's CPU time (a shared machine)")
    p.add_argument("--compile", action="store_true",
                   help="each step also compiled (and the rival with SparseAdam / RowAdam, lst-train's)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.update_results:
        p.error("--update-results: this benchmark has no committed results; give --out")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.m, args.d, generator=g), zipf_targets(args.m, args.D, g)) for _ in range(8)]
    # name -> (step, compiled, the rival's optimiser it is held to)
    steps = {"default": (default_step(args.D, args.d), False, "sgd"),
             "sampled_softmax": (sampled_softmax_step(args.D, args.d), False, "sgd")}
    first_s = {}
    if args.compile:
        torch._inductor.config.compile_threads = 1  # the C++ compiles in this process: its CPU time
        torch.compiler.config.force_disable_caches = True  # a cold compile each run
        steps |= {"default+compiled": (default_step(args.D, args.d, compiled=True), True, "sgd"),
                  "sampled_softmax+compiled": (sampled_softmax_compiled_step(args.D, args.d), True, "sgd"),
                  "sampled_softmax_adam": (sampled_softmax_step(args.D, args.d, "adam"), False, "adam"),
                  "sampled_softmax_adam+compiled": (sampled_softmax_compiled_step(args.D, args.d, "adam"), True,
                                                    "adam")}
        for name, (step, compiled, _) in steps.items():
            if compiled:
                t0 = time.process_time()
                for i in range(COMPILE_CALLS):
                    step(*batches[i % len(batches)])
                first_s[name] = time.process_time() - t0
    print(f"D={args.D:,} d={args.d} m={args.m}, one thread, torch {torch.__version__}")
    # timed in alternation, 5 steps each a round: a load that comes and goes falls on all alike
    medians = interleaved_medians({k: (cycled(v[0], batches), 5) for k, v in steps.items()}, args.steps // 5,
                                  warmup=10, clock=perf_clock if args.clock == "wall" else cpu_clock)
    rival = {opt: min(medians[k] for k, v in steps.items() if k.startswith("sampled_softmax") and v[2] == opt)
             for opt in {v[2] for v in steps.values()}}
    out, rows = output_dir(args, "bench_step_cpu"), []
    facts = {**provenance(), "D": args.D, "d": args.d, "m": args.m, "threads": 1, "clock": args.clock}
    for name, (step, compiled, opt) in steps.items():
        ms = 1e3 * medians[name]
        compile_s = first_s[name] - COMPILE_CALLS * medians[name] if compiled else None
        profiled, ops = (None, Counter()) if compiled else counted(step, batches[0])
        counts = (f"compiled in {compile_s:5.1f} s of CPU" if compiled else
                  f"{profiled:5d} op calls/step profiled, {sum(ops.values()):4d} dispatched")
        print(f"{name:>29}: {ms:7.2f} ms/step  {counts}")
        if args.top and not compiled:
            print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top)))
        rows.append({**facts, "head": name, "compiled": compiled, "optimizer": opt, "ms_per_step": round(ms, 4),
                     "compile_s": None if compile_s is None else round(compile_s, 2), "ops_profiled": profiled,
                     "ops_dispatched": None if compiled else sum(ops.values()),
                     "over_sampled_softmax": round(medians[name] / medians["sampled_softmax"], 4),
                     "over_rival_best": round(medians[name] / rival[opt], 4)})
    print(f"default / sampled_softmax: {medians['default'] / medians['sampled_softmax']:.2f}x")
    if args.compile:
        for name in ("default", "sampled_softmax", "sampled_softmax_adam"):
            print(f"{name} compiled / eager: {medians[name + '+compiled'] / medians[name]:.2f}x")
        print(f"default+compiled / sampled_softmax+compiled: "
              f"{medians['default+compiled'] / medians['sampled_softmax+compiled']:.2f}x; "
              f"/ the rival's fastest (SGD): {medians['default+compiled'] / rival['sgd']:.2f}x")
    wrote(write_csv(out / "step_cpu.csv", rows))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(50):
            steps["default"][0](*batches[i % len(batches)])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
