"""The factored head's step, counted rather than timed: the FLOPs of its matrix products by
where the code makes them (in units of one m x d x d product, 2 m d^2 FLOPs, d the head's
width: the hidden size, plus one where the head has a bias) and the
operators it runs, per step. On a GPU each operator is about one kernel, so these are the
numbers a CUDA graph's replay follows (docs/benchmarks.md, "What stands between the graph
step and 0.2 ms"), and they are the same on any machine: a change to the step can be
weighed on a CPU before a GPU times it.

    python3 scripts/count_step.py [--D 793471 --d 512 --m 1024] [--loss zloss|sampled] [--negatives S]
        [--sync-every 64] [--inverse products] [--out DIR | --update-results]

By default the GPU's step: device flags (``sync_every=64``, the unit ``CudaGraphStep``
captures) and U_new^-1 by products, counted after a read of the flags (under the default
``neumann="adaptive"`` the steps after a read take the Neumann factors it chose from the rho
seen; the table says how many). ``--loss sampled`` is lst-train's default head: its
negatives (``--negatives``: S of them; default lst-train's S for D) and its right
preconditioner at their settings. Factorisations and triangular solves are not products:
the table lists them apart, outside the units. Writes
``count_step_<loss>_D<D>_d<d>_m<m>.md`` (machine-free: counts, not times) into a fresh run
directory, ``--out DIR``, or with ``--update-results`` the committed benchmarks/results/.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import add_output_args, output_dir

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from bench_heads import TARGET, app_head_kwargs
from lst_lightning.spherical import FactoredSphericalHead

#: source files whose frames name a call site (the innermost one of them is the site)
OURS = ("/lst_lightning/", "/lst_kernels/")


def call_site() -> str:
    """``file:function`` of the innermost frame of this project's code on the stack."""
    return next((f"{Path(fr.filename).name}:{fr.name}" for fr in reversed(traceback.extract_stack())
                 if any(o in fr.filename for o in OURS)), "elsewhere")


class StepCounter(TorchDispatchMode):
    """Counts, under it, every operator but views, by name and by the innermost frame of this
    project's code that ran it (``file:function``), and the FLOPs of each matrix product by that frame."""

    def __init__(self):
        super().__init__()
        self.width = 0
        self.ops: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.flops: Counter[str] = Counter()
        self.gemms: Counter[str] = Counter()
        self.factors: int | None = None    # the counted step's Neumann factors (device flags)
        self.negatives: int | None = None  # S, the shared negatives (loss=sampled)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        site = call_site()
        self.ops[str(func.overloadpacket)] += 1
        self.sites[site] += 1
        counter = flop_registry.get(func.overloadpacket)
        if counter is not None:
            self.flops[site] += counter(*args, **kwargs, out_val=out)
            self.gemms[site] += 1
        return out


#: operators that are linear algebra but not matrix products (factorisations, triangular solves,
#: eigenvalues; norms aside): counted apart, outside the units
LAPACK = ("aten.linalg_", "aten._linalg_", "aten.cholesky", "aten.triangular_solve", "aten.lu_")


def is_lapack(op: str) -> bool:
    return op.startswith(LAPACK) and "norm" not in op


def make_head(D: int, d: int, loss: str, sync_every: int, inverse: str,
              negatives: int | None = None) -> FactoredSphericalHead:
    """The factored head as lst-train builds it for ``loss`` (sampled: negatives and the
    preconditioner at their settings; ``negatives``: S of them, None: lst-train's S for D),
    its step driven as ``sync_every`` says."""
    kwargs = app_head_kwargs(loss)
    if negatives is not None and "negatives" in kwargs:
        kwargs["negatives"] = {**kwargs["negatives"], "num": negatives}
    return FactoredSphericalHead(num_classes=D, hidden_dim=d, loss=loss, sync_every=sync_every,
                                 stabiliser={"inverse": inverse}, **kwargs)


def count(D: int, d: int, m: int, loss: str = "zloss", sync_every: int = 64, inverse: str = "products",
          warmup: int = 3, negatives: int | None = None) -> StepCounter:
    """One step of ``train_step`` counted on a fresh batch (rows of unit norm on average, one
    random target each), after twice ``warmup`` steps on fresh batches, each run followed by a
    read of the device flags (``head.sync()``, as every ``sync_every`` steps): the adaptive
    Neumann factors of the counted step are chosen from the rho of the steps past the start."""
    torch.manual_seed(0)
    head = make_head(D, d, loss, sync_every, inverse, negatives)

    def batch():
        return torch.randn(m, d) / d ** 0.5, torch.randint(0, D, (m, 1))

    for _ in range(2):
        for _ in range(warmup):
            head.train_step(*batch())
        head.sync()
    H, idx = batch()
    counter = StepCounter()
    with counter:
        head.train_step(H, idx)
    counter.width = head.width  # d, and one more where the head has a bias (H augmented)
    counter.factors = head.step_checks.factors
    counter.negatives = None if head.negatives is None else head.negatives.settings.num
    return counter


def table(c: StepCounter, D: int, d: int, m: int, loss: str, sync_every: int, inverse: str) -> str:
    unit = 2 * m * c.width ** 2
    total = sum(c.flops.values())
    steps = [f"S={c.negatives} shared negatives"] if c.negatives else []
    if c.factors is not None and inverse == "products":
        steps.append(f"{c.factors} Neumann factors (Stabiliser.neumann's, after a read of the flags)")
    lapack = {op: n for op, n in c.ops.items() if is_lapack(op)}
    lines = [f"# The factored step counted: loss={loss}, D={D:,}, d={d} (width {c.width}), m={m}, "
             f"sync_every={sync_every}, inverse={inverse}", "",
             f"**{total / unit:.2f} units of 2 m d^2** ({total / 1e9:.3g} GFLOP) in {sum(c.gemms.values())} matrix "
             f"products; **{sum(c.ops.values())} operators** (views not counted) a step."
             + (f" The step: {'; '.join(steps)}." if steps else ""), "",
             "Not products, outside the units (factorisations, triangular solves): "
             + (", ".join(f"`{op}` {n}" for op, n in sorted(lapack.items())) or "none") + ".", "",
             "| where | products | units of 2 m d^2 |", "|---|---:|---:|"]
    for site, f in sorted(c.flops.items(), key=lambda kv: -kv[1]):
        lines.append(f"| `{site}` | {c.gemms[site]} | {f / unit:.2f} |")
    lines += ["", "Operators by where they run (`reference.py`: the CPU's torch form of a sparse op, which a",
              "GPU runs as one Triton kernel, two with its sort):", "", "| where | operators |", "|---|---:|"]
    lines += [f"| `{site}` | {n} |" for site, n in c.sites.most_common()]
    lines += ["", "| operator | a step |", "|---|---:|"]
    lines += [f"| `{op}` | {n} |" for op, n in c.ops.most_common()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=int, default=TARGET["D"])
    p.add_argument("--d", type=int, default=TARGET["d"])
    p.add_argument("--m", type=int, default=TARGET["m"])
    p.add_argument("--loss", default="zloss", help="the factored head's loss (sampled: lst-train's default head)")
    p.add_argument("--negatives", type=int, default=None, help="S with --loss sampled (default: lst-train's for D)")
    p.add_argument("--sync-every", type=int, default=64, help="1: the host-checked step (a CPU's)")
    p.add_argument("--inverse", default="products", help="the route to H U_new^-1 (Stabiliser.inverse)")
    add_output_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    c = count(args.D, args.d, args.m, args.loss, args.sync_every, args.inverse, negatives=args.negatives)
    text = table(c, args.D, args.d, args.m, args.loss, args.sync_every, args.inverse)
    print(text)
    path = output_dir(args, "count_step") / f"count_step_{args.loss}_D{args.D}_d{args.d}_m{args.m}.md"
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
