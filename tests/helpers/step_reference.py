"""A hundred float64 steps of the factored head in each of its modes, and the state they end in.

``tests/spherical/data/step_reference.pt`` holds each mode's state after ``STEPS`` steps as the
code made it when the file was written; tests/spherical/test_step_reference.py holds the step to
it. ``python tests/helpers/step_reference.py`` writes the file again (only when the step is
meant to change its numbers); ``--out FILE`` writes the runs to FILE instead, and ``--twins NAME...``
adds each named eager mode compiled (``compiled_twin``).

Every run is made with the same CPU kernels whatever the machine (``KERNELS``: ATen's and MKL's
AVX2 code, one thread): main runs itself again under them where they are not set. An AVX-512
machine's vectorised sums round otherwise, and over a hundred steps (the folds, the repairs' power
iterations) that parts the runs by up to 1e-7, past the file's 1e-12. A machine without AVX2
cannot make them: main exits with ``NO_AVX2``.

A mode is the head's settings and how a loop drives it: ``backward`` (``head(H, idx).backward()``),
``train_step`` (``head.train_step``) or ``accumulate`` (attached to an optimizer, two micro-batches
of different sizes a step). The batches have padding, repeated classes within and across rows, and
H scaled so that the repairs (folds, singular-value fixes, refreshes) run within the hundred steps.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

from lst_lightning.spherical import FactoredSphericalHead

STEPS = 100
D, d, K = 80, 8, 3
PATH = Path(__file__).resolve().parents[1] / "spherical" / "data" / "step_reference.pt"
#: the CPU kernels the runs are made with (ATen's dispatch, MKL's, the threads), on every machine
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
NO_AVX2 = 3  # main's exit status on a machine without AVX2
#: the repairs often enough that a hundred steps meet each of them
REPAIRS = dict(check_every=25, uinv_refresh_every=20, q_refresh_every=50)
SAMPLED = dict(loss="sampled", negatives=dict(num=8, seed=3), preconditioner={})  # lst-train's default head
PER_ROW = dict(loss="sampled", negatives=dict(num=6, seed=5, shared=False))


def mode(drive="backward", m=4, scale=1.0, compiled=False, lr=0.2, bad=False, **head):
    """``bad``: one batch has a row of H not finite (the step is skipped, its write masked)."""
    return dict(drive=drive, m=m, scale=scale, compiled=compiled, lr=lr, bad=bad, head=head)


def routes():
    """Each U^-1 route, with the flags read after every step and every 8 (the products route: both Neumann rules)."""
    out = {}
    for route in ("woodbury", "solve", "products"):
        for sync in (1, 8):
            out[f"zloss_{route}_sync{sync}"] = mode(loss="zloss", sync_every=sync, stabiliser=dict(inverse=route))
    out["zloss_products_max_sync8"] = mode(loss="zloss", sync_every=8, stabiliser=dict(inverse="products",
                                                                                       neumann="max"))
    return out


MODES = {
    # the Z-loss: autograd and fused steps, the flags read after every step and every 8, both Q routes
    # (m < d: M; m > d: factors)
    "zloss_autograd_sync1": mode(loss="zloss", sync_every=1),
    "zloss_autograd_sync8": mode(loss="zloss", sync_every=8),
    "zloss_fused_sync1": mode(loss="zloss", sync_every=1, step="fused"),
    "zloss_fused_sync8": mode(loss="zloss", sync_every=8, step="fused"),
    "zloss_train_step_sync8": mode("train_step", loss="zloss", sync_every=8),
    "zloss_factors_sync1": mode(m=20, loss="zloss", sync_every=1),
    "zloss_factors_sync8": mode(m=20, loss="zloss", sync_every=8),
    "zloss_folds_sync1": mode(scale=3.0, lr=3.0, loss="zloss", sync_every=1),
    "zloss_folds_sync8": mode(scale=3.0, lr=3.0, loss="zloss", sync_every=8),
    "zloss_bad_batch_sync1": mode(bad=True, loss="zloss", sync_every=1),
    "zloss_bad_batch_sync8": mode(bad=True, loss="zloss", sync_every=8),
    "sampled_bad_batch_sync8": mode(bad=True, **SAMPLED, sync_every=8, step="fused"),
    "mse_sync8": mode(loss="mse", sync_every=8, bias=False),
    **routes(),
    # the right preconditioner P alone
    "zloss_P_sync1": mode(loss="zloss", sync_every=1, preconditioner={}),
    "zloss_P_sync8": mode(loss="zloss", sync_every=8, preconditioner={}, stabiliser=dict(inverse="products")),
    "zloss_P_factors_sync8": mode(m=20, loss="zloss", sync_every=8, preconditioner={}),
    # lst-train's default: loss=sampled, shared negatives, P
    "sampled_autograd_sync1": mode(**SAMPLED, sync_every=1),
    "sampled_autograd_sync8": mode(**SAMPLED, sync_every=8),
    "sampled_fused_sync8": mode(**SAMPLED, sync_every=8, step="fused"),
    "sampled_products_sync8": mode(**SAMPLED, sync_every=8, stabiliser=dict(inverse="products")),
    "sampled_factors_sync8": mode(m=20, **SAMPLED, sync_every=8),
    "sampled_noP_sync8": mode(loss="sampled", negatives=dict(num=8, seed=3), sync_every=8),
    # negatives per row, from a static proposal
    "per_row_sync1": mode(**PER_ROW, sync_every=1),
    "per_row_sync8": mode(**PER_ROW, sync_every=8),
    # exact accumulation: two micro-batches a step
    "zloss_accumulate_sync1": mode("accumulate", loss="zloss", sync_every=1),
    "zloss_accumulate_sync8": mode("accumulate", loss="zloss", sync_every=8),
    "sampled_accumulate_sync8": mode("accumulate", **SAMPLED, sync_every=8),
    # the device part compiled whole (aot_eager: Dynamo's graph run by torch's own kernels)
    "compiled_zloss_autograd": mode(loss="zloss", sync_every=8, compile_step=True, compiled=True),
    "compiled_sampled_fused": mode(**SAMPLED, sync_every=8, step="fused", compile_step=True, compiled=True),
    "compiled_sampled_accumulate": mode("accumulate", **SAMPLED, sync_every=8, compile_step=True, compiled=True),
}


def batches(m: int, scale: float, bad: bool = False, seed: int = 0):
    """STEPS batches of m rows (accumulation: two micro-batches of m and m + 1 rows, one with fewer targets)."""
    g = torch.Generator().manual_seed(seed)

    def one(rows, k):
        H = torch.randn(rows, d, generator=g, dtype=torch.float64) * scale
        idx = torch.randint(0, 30, (rows, k), generator=g)
        if k > 1:
            idx[0, -1] = -1
            idx[1, 1] = idx[1, 0]
        idx[2, 0] = idx[0, 0]
        return H, idx

    first, second = [one(m, K) for _ in range(STEPS)], [one(m + 1, K - 1) for _ in range(STEPS)]
    if bad:
        first[37][0][1, 2] = float("nan")
    return first, second


def compiled_twin(spec: dict) -> dict:
    """An eager mode's settings with its device part compiled whole, its batches' rows each a batch
    size (no padding rows: the same U^-1 route as eager)."""
    sizes = tuple(sorted({spec["m"], spec["m"] + 1, 2 * spec["m"] + 1}))
    return {**spec, "compiled": True, "head": {**spec["head"], "compile_step": True, "batch_sizes": sizes}}


def run(name: str, spec: dict | None = None) -> dict[str, torch.Tensor]:
    """Mode ``name``'s hundred steps (``spec``: its settings, by default ``MODES[name]``): the head's
    buffers, its counters, the losses and the last dL/dH."""
    spec = MODES[name] if spec is None else spec
    settings = {"bias": True, **spec["head"]}
    settings["stabiliser"] = {**REPAIRS, **settings.get("stabiliser", {})}
    head = FactoredSphericalHead(D, d, **settings, lr=spec["lr"], weight_decay=0.01, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(0))
    first, second = batches(spec["m"], spec["scale"], spec["bad"])
    if spec["drive"] == "accumulate":
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        head.attach(opt)
    losses, dH = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bad batch's skipped step
        for i in range(STEPS):
            H, idx = first[i]
            if spec["drive"] == "train_step":
                loss, dH = head.train_step(H, idx)
            else:
                H = H.clone().requires_grad_()
                loss = head(H, idx)
                (loss * (0.5 if spec["drive"] == "accumulate" else 1.0)).backward()
                if spec["drive"] == "accumulate":
                    H2 = second[i][0].clone().requires_grad_()
                    (head(H2, second[i][1]) * 0.5).backward()
                    opt.step()
                dH = H.grad
            losses.append(loss.detach())
        head.sync()
    out = {name: getattr(head, name).clone() for name in ("V", "U", "Uinv", "omega", "Q", "wbar")}
    out["W"] = head.weight()
    out["stats"] = torch.tensor(list(head.stats().values()), dtype=torch.float64)
    out["losses"] = torch.stack(losses)
    out["dH"] = dH.detach().clone()
    return out


def compiling(spec):
    """The compiled modes run Dynamo's graph on aot_eager (the graph whole, no Inductor code generation)."""
    import contextlib
    from unittest import mock

    from lst_lightning.spherical import driver
    if not spec["compiled"]:
        return contextlib.nullcontext()
    compile_ = torch.compile
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw)))
    stack.enter_context(mock.patch.object(driver, "_compiled", {}))
    return stack


def run_mode(name: str, spec: dict | None = None) -> dict[str, torch.Tensor]:
    spec = MODES[name] if spec is None else spec
    with compiling(spec):
        torch._dynamo.reset()
        try:
            return run(name, spec)
        finally:
            torch._dynamo.reset()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(os.environ.get(k) != v for k, v in KERNELS.items()):  # the kernels pinned: this process again
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], {**os.environ, **KERNELS})
    parser = argparse.ArgumentParser(description="a hundred float64 steps of each mode, under KERNELS")
    parser.add_argument("names", nargs="*", help="modes (default: all, the file's)")
    parser.add_argument("--out", type=Path, help="write the runs here (default: the pinned file, updated)")
    parser.add_argument("--twins", nargs="*", default=[], help="eager modes to run compiled too ('twin:NAME')")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        print(f"the runs are pinned to ATen's AVX2 kernels; this machine gives {torch.backends.cpu.get_cpu_capability()}")
        sys.exit(NO_AVX2)
    out = args.out or PATH
    ref = torch.load(PATH) if args.out is None and PATH.exists() else {}
    for name in args.names or list(MODES):
        ref[name] = run_mode(name)
        stats = ref[name]["stats"].tolist()
        print(name, f"steps {stats[0]:.0f}, skipped {stats[1]:.0f}, folds {stats[5]:.0f}, sv fixes {stats[3]:.0f}")
    for name in args.twins:
        ref[f"twin:{name}"] = run_mode(name, compiled_twin(MODES[name]))
    out.parent.mkdir(exist_ok=True)
    torch.save(ref, out)


if __name__ == "__main__":
    main()
