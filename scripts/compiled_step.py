"""The factored head's step compiled whole, measured: its graph breaks (``torch._dynamo.explain``),
the kernels Inductor makes of it (fused loops, matrix products and other calls, read from the
code it generates: on a GPU each is one launch), its compile time, and its time against the
same step eager, side by side in one run (one torch thread on a CPU): the fused step (lst-train's
unit, ``train_step``) eager and compiled, on a GPU also inside a CUDA graph (``CudaGraphStep``);
and compiled as the other loops drive it, the autograd step (a plain loop, the HF Trainer,
Fabric) and exact accumulation's (an attached head: the Trainer's and lst-train's with
gradient accumulation).

    python3 scripts/compiled_step.py [--D 793471 --d 512 --m 1024] [--loss zloss sampled]
        [--inverse products] [--steps 5] [--batch-sizes] [--smoke] [--out DIR | --update-results]

``--loss sampled`` is lst-train's default head (sampled classes and the right preconditioner at
their settings for D). The rows have unit norm on average, as count_step.py's, and each head
steps twice and reads its flags before it is measured: its Neumann factors (``neumann="adaptive"``)
are those of a run's steady state. ``--inverse products`` (the default) is the GPU's route to U_new^-1, the
step a GPU compiles; ``--inverse auto`` the CPU's. Writes ``compiled_step.csv`` (a row per
loss) into a fresh run directory, ``--out DIR``, or with ``--update-results`` appends it to the
committed ``benchmarks/results/compiled_step.csv`` through ``scripts/results_pages.py add``.
``--smoke``: tiny sizes, one step, for the test suite.

``--batch-sizes`` measures batches of changing sizes instead (batch_shapes.py; ``--m 1000`` for
the figures of docs/results/compiled_batch_sizes.md): the fused step of m rows padded to its batch
size (1024 for 1000) against a head whose one batch size is m (no padding), timed in alternation
(target: at most 1.15 x); and 30 random sizes from 1 to m, m = 1 first, through a fresh compiled
head as lst-train steps it (fused; on a GPU ``step="cuda_graph"``, which also captures a graph
a batch size): the graphs compiled (and captured) and the seconds the 30 steps took, compiles
included. Writes
``compiled_batch_sizes.csv`` (a row per loss) as above.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import add_output_args, clock_for, interleaved_times, output_dir, save_rows

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from bench_heads import app_head_kwargs, loss_settings
from gpu_targets import MAX_MS, MAX_PADDED_RATIO, MAX_ROUTE_RATIO, TARGET, verdict
from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.spherical import driver, exact_step
from lst_lightning.spherical.batch_shapes import padded_rows
from lst_lightning.spherical.graph_step import CudaGraphStep

SMOKE = {"D": 300, "d": 16, "m": 32}
#: the random batch sizes of ``--batch-sizes``
NUM_SIZES = 30
BATCH_COLUMNS = ["device", "loss", "inverse", "D", "d", "m", "padded_to", "static_ms", "padded_ms", "padded_over_static",
                 "sizes", "largest", "graphs", "sizes_s", "captures"]
COLUMNS = ["device", "loss", "inverse", "D", "d", "m", "factors", "graphs", "breaks", "ops", "fused_loops", "products",
           "other_calls", "kernels", "compile_s", "eager_ms", "compiled_ms", "graph_ms", "autograd_ms",
           "accumulated_ms", "speedup"]
#: a line of Inductor's wrapper that launches one kernel: its generated loops (C++ on a CPU, Triton
#: on a GPU), a library matrix product, or another call (a sort, a scan, a solve, the project's kernels)
FUSED = re.compile(r"^\s*(cpp_fused_\w+|triton_\w+\.run|triton_\w+)\(")
PRODUCT = re.compile(r"^\s*(\w+ = )?extern_kernels\.(mm|addmm|bmm|baddbmm|_mm_plus_mm)\(")
OTHER = re.compile(r"^\s*(\w+ = )?(extern_kernels\.\w+|aten\.\w+|torch\.ops\.\w+\.\w+|\w+_kernel\w*\.run)[.(\w]*\(")


def wrapper_calls(code: str) -> dict[str, int]:
    """Kernels per call of Inductor's wrapper ``code``: its ``call`` function's launches by kind."""
    body = code.split("def call(", 1)[1].split("\ndef ", 1)[0]
    counts = {"fused_loops": 0, "products": 0, "other_calls": 0}
    for line in body.splitlines():
        if FUSED.match(line):
            counts["fused_loops"] += 1
        elif PRODUCT.match(line):
            counts["products"] += 1
        elif OTHER.match(line) and "reinterpret_tensor" not in line and "empty_strided" not in line:
            counts["other_calls"] += 1
    return counts


def make_head(loss: str, D: int, d: int, inverse: str, device: torch.device, compile_step: bool, batches: list):
    """The head as lst-train builds it, settled as count_step.py settles it: two runs of three eager
    steps, each followed by a read of its flags, so that its Neumann factors are those of the steps
    past the start (``Stabiliser.neumann="adaptive"``: the most until the first read); then its
    step compiled or not."""
    lr, loss_kwargs = loss_settings(loss, D)
    head = FactoredSphericalHead(D, d, loss=loss, loss_kwargs=loss_kwargs, lr=lr, bias=False, device=device,
                                 stabiliser={"inverse": inverse}, compile_step=False,
                                 generator=torch.Generator().manual_seed(0), **app_head_kwargs(loss))
    for run in range(2):
        for H, idx in batches[3 * run:3 * run + 3]:
            head.train_step(H, idx)
        head.sync()
    head.compile_step = compile_step
    return head


def explained(head, H, idx) -> tuple[int, int, int]:
    """(graphs, graph breaks, operators) of the step's device part as Dynamo traces it."""
    Hx, idx, T = head.prepare(H.detach(), idx, None, step=True)
    draws, route = driver.before_step(head, Hx.shape[0])
    out = torch._dynamo.explain(exact_step.device_step)(head.plan, driver.step_state(head),
                                                        exact_step.Batch(Hx, idx, T), head.device_lr(), draws, route)
    torch._dynamo.reset()
    return out.graph_count, out.graph_break_count, out.op_count


def unit_batches(D: int, d: int, m: int, device: torch.device, n: int = 8) -> list:
    """count_step.py's batches: rows of unit norm on average, one uniform target each."""
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(m, d, generator=g) / d ** 0.5).to(device), torch.randint(0, D, (m,), generator=g).to(device))
            for _ in range(n)]


def measure(loss: str, D: int, d: int, m: int, inverse: str, steps: int, device: torch.device,
            backend: str = "inductor") -> dict:
    batches = unit_batches(D, d, m, device)
    eager, fast = (make_head(loss, D, d, inverse, device, c, batches) for c in (False, True))
    graphs, breaks, ops = explained(eager, *batches[6])
    H, idx = batches[6]
    t0 = time.perf_counter()
    if backend == "inductor":
        _, codes = run_and_get_code(fast.train_step, H, idx)  # compiles: the wrapper's code
        kernels = {"fused_loops": 0, "products": 0, "other_calls": 0}
        for code in codes:
            for k, v in wrapper_calls(code).items():
                kernels[k] += v
    else:  # no generated code to read
        fast.train_step(H, idx)
        kernels = {"fused_loops": None, "products": None, "other_calls": None}
    compile_s = time.perf_counter() - t0
    cycle = iter(range(1 << 30))

    def stepper(step):
        return lambda: step(*batches[6 + next(cycle) % 2])

    steppers = {"eager": (stepper(eager.train_step), 1), "compiled": (stepper(fast.train_step), 1),
                "autograd": (stepper(autograd_step(make_head(loss, D, d, inverse, device, True, batches))), 1),
                "accumulated": (stepper(accumulated_step(make_head(loss, D, d, inverse, device, True, batches))), 1)}
    if device.type == "cuda":  # the compiled step inside a CUDA graph (step="cuda_graph"'s unit)
        graphed = make_head(loss, D, d, inverse, device, True, batches)
        steppers["graph"] = (stepper(CudaGraphStep(graphed, m, 1)), 1)
    times = interleaved_times(steppers, rounds=steps, warmup=1, clock=clock_for(device))
    ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    return {"device": device.type, "loss": loss, "inverse": inverse, "D": D, "d": d, "m": m,
            "factors": fast.step_checks.factors, "graphs": graphs,
            "breaks": breaks, "ops": ops, **kernels, "compile_s": round(compile_s, 1),
            "kernels": None if kernels["products"] is None else sum(kernels.values()),
            "eager_ms": ms["eager"], "compiled_ms": ms["compiled"], "graph_ms": ms.get("graph"),
            "autograd_ms": ms["autograd"], "accumulated_ms": ms["accumulated"],
            "speedup": round(ms["eager"] / ms["compiled"], 3)}


def random_sizes(most: int, n: int = NUM_SIZES, seed: int = 0) -> list[int]:
    """n batch sizes from 1 to ``most``, 1 first (the hard one), the rest uniform."""
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(1, most + 1, (n - 1,), generator=g).tolist()


def measure_batch_sizes(loss: str, D: int, d: int, m: int, inverse: str, steps: int, device: torch.device) -> dict:
    """The fused step of m rows padded to its batch size against exactly m rows; then
    ``NUM_SIZES`` random sizes through a fresh compiled head (and on a GPU its CUDA graphs)."""
    batches = unit_batches(D, d, m, device)
    padded, static = (make_head(loss, D, d, inverse, device, True, batches) for _ in range(2))
    static.batch_sizes = (m,)
    cycle = iter(range(1 << 30))

    def stepper(head):
        return lambda: head.train_step(*batches[6 + next(cycle) % 2])

    times = interleaved_times({"padded": (stepper(padded), 1), "static": (stepper(static), 1)}, rounds=steps,
                              warmup=1, clock=clock_for(device))
    ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    sizes = random_sizes(m)
    H, idx = batches[6]
    torch._dynamo.reset()
    counters.clear()
    fresh = make_head(loss, D, d, inverse, device, True, batches)
    # lst-train's step: fused on a CPU; on a GPU replayed from a CUDA graph a batch size, captured at its first
    fresh.step = "cuda_graph" if device.type == "cuda" else "fused"
    t0 = time.perf_counter()
    for n in sizes:
        fresh(H[:n].clone().requires_grad_(), idx[:n]).backward()
    fresh.sync()
    sizes_s = time.perf_counter() - t0
    captures = len(fresh.graph_sizes) if device.type == "cuda" else None
    return {"device": device.type, "loss": loss, "inverse": inverse, "D": D, "d": d, "m": m,
            "padded_to": padded_rows(m, padded.batch_sizes), "static_ms": ms["static"], "padded_ms": ms["padded"],
            "padded_over_static": round(ms["padded"] / ms["static"], 3), "sizes": len(sizes), "largest": max(sizes),
            "graphs": counters["stats"]["unique_graphs"], "sizes_s": round(sizes_s, 1), "captures": captures}


def batch_size_targets(row: dict) -> list[str]:
    """PASS / FAIL lines of ``--batch-sizes``: the padded step within ``MAX_PADDED_RATIO`` of the
    static one, and at most log2(largest) + 2 graphs over the random sizes."""
    name = f"batches of any size, loss={row['loss']}"
    ratio, bound = row["padded_over_static"], max(1, row["largest"] - 1).bit_length() + 2
    padded = (f"{verdict(ratio, MAX_PADDED_RATIO)} {name}: m = {row['m']} padded to "
              f"{row['padded_to']} takes {ratio:.3f} x the step of exactly {row['m']} rows (target <= "
              f"{MAX_PADDED_RATIO} x)")
    graphs = (f"{verdict(row['graphs'], bound)} {name}: {row['graphs']} graphs over {row['sizes']} "
              f"random sizes up to {row['largest']} (target <= {bound})")
    return [padded, graphs]


def autograd_step(head):
    """The compiled step as a plain loop, the HF Trainer or Fabric drive it: the head's forward,
    then ``backward()`` (two graphs: the forward, the update)."""
    def step(H, idx):
        head(H.requires_grad_(), idx).backward()
    return step


def accumulated_step(head):
    """The step of exact accumulation (the HF Trainer's and lst-train's with accumulation): the
    head attached to an optimizer, one micro-batch and the optimizer's step (the records' graph)."""
    opt = torch.optim.SGD([torch.zeros(1, device=head.device, requires_grad=True)])
    head.attach(opt)

    def step(H, idx):
        head(H.requires_grad_(), idx).backward()
        opt.step()
    return step


def targets(row: dict) -> list[str]:
    """PASS / FAIL lines of the GPU targets for a row at the target size on CUDA; UNMEASURED elsewhere."""
    name = f"compiled step, loss={row['loss']}"
    at_target = row["device"] == "cuda" and all(row[k] == TARGET[k] for k in ("D", "d", "m"))
    if not at_target or row["inverse"] != "products":
        return [f"UNMEASURED {name}: the targets are for D={TARGET['D']}, d={TARGET['d']}, m={TARGET['m']} on a GPU"]
    limit = MAX_MS[row["loss"]]
    lines = [f"{verdict(row[k], limit)} {name}, {what}: {row[k]:.3f} ms (target <= {limit} ms)"
             for k, what in (("compiled_ms", "no graph"), ("graph_ms", "inside a CUDA graph"))]
    for k, route in (("autograd_ms", "the autograd step (a plain loop, Fabric)"),
                     ("accumulated_ms", "the accumulated step (the HF Trainer)")):
        ratio = row[k] / row["graph_ms"]
        lines.append(f"{verdict(ratio, MAX_ROUTE_RATIO)} {name}, {route}: {ratio:.2f} x lst-train's "
                     f"graph step (target <= {MAX_ROUTE_RATIO} x)")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, each size not given at the target's (``--smoke``: tiny ones)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=int, default=TARGET["D"], help=f"classes (--smoke: {SMOKE['D']})")
    p.add_argument("--d", type=int, default=TARGET["d"], help=f"hidden size (--smoke: {SMOKE['d']})")
    p.add_argument("--m", type=int, default=TARGET["m"],
                   help=f"rows a batch (--smoke: {SMOKE['m']}, with --batch-sizes {3 * SMOKE['m'] // 4}, padded to "
                        f"{SMOKE['m']})")
    p.add_argument("--loss", nargs="+", default=["zloss", "sampled"], choices=["zloss", "sampled"])
    p.add_argument("--inverse", default="products", choices=["products", "auto"])
    p.add_argument("--steps", type=int, default=5, help="timed steps of each, in alternation (--smoke: 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, one timed step (the test suite); sizes given still count")
    p.add_argument("--batch-sizes", action="store_true",
                   help="batches of changing sizes: m padded against exactly m, and 30 random sizes' graphs")
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"],
                   help="torch.compile's backend (aot_eager: the same graphs without Inductor's code: no kernel counts)")
    add_output_args(p)
    known = p.parse_known_args(argv)[0]
    if known.smoke:  # tiny defaults; with --batch-sizes 24 rows, padded to 32
        p.set_defaults(**{**SMOKE, "steps": 1, **({"m": 3 * SMOKE["m"] // 4} if known.batch_sizes else {})})
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.backend != "inductor":
        compile_ = torch.compile
        torch.compile = lambda fn, **kw: compile_(fn, backend=args.backend, **kw)
    device = torch.device(args.device)
    torch._inductor.config.fx_graph_cache = False  # each compile timed in full, not read from an earlier run's cache
    if device.type == "cpu":
        torch.set_num_threads(1)
    name, columns, measured, checked = ("compiled_batch_sizes", BATCH_COLUMNS, measure_batch_sizes, batch_size_targets) \
        if args.batch_sizes else ("compiled_step", COLUMNS, measure, targets)
    rows = []
    for loss in args.loss:
        extra = () if args.batch_sizes else (args.backend,)
        rows.append(measured(loss, args.D, args.d, args.m, args.inverse, args.steps, device, *extra))
        print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        print("\n".join(checked(rows[-1])), flush=True)
    save_rows(args, output_dir(args, name), name, rows, columns, argv)
    return rows


if __name__ == "__main__":
    main()
