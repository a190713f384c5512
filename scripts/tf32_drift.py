"""How far the factored head drifts from its float64 self with TensorFloat-32 products: the same
steps (the same W, batches and draws) in float64, in float32 with full float32 products (the
default) and in float32 with TF32 products (``tf32=True``, opt-in), the relative gap of each
float32 head's implicit W to the float64 head's every ``--every`` steps.

    python3 scripts/tf32_drift.py [--D 10000 --d 256 --m 256] [--steps 10000 --every 500]
        [--loss zloss sampled] [--smoke] [--out DIR | --update-results]

On a GPU the heads' steps run compiled (their default there). Writes ``tf32_drift.csv`` (a row
per loss, precision and checkpoint) into a fresh run directory, ``--out DIR``, or with
``--update-results`` appends it to the committed ``benchmarks/results/tf32_drift.csv`` through
``scripts/results_pages.py add``. ``--smoke``: tiny sizes and a few steps, for the test suite.
"""
from __future__ import annotations

import argparse

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import add_output_args, output_dir, save_rows, zipf_targets

import torch

from bench_heads import app_head_kwargs, loss_settings
from lst_lightning.spherical import FactoredSphericalHead

COLUMNS = ["device", "loss", "precision", "D", "d", "m", "step", "rel_w"]
PRECISIONS = {"float32": (torch.float32, False), "tf32": (torch.float32, True)}


def heads(loss: str, D: int, d: int, device: torch.device) -> dict[str, FactoredSphericalHead]:
    """The float64 reference and the float32 heads at its W, drawing the same negatives."""
    lr, loss_kwargs = loss_settings(loss, D)

    def make(dtype, tf32):
        return FactoredSphericalHead(D, d, loss=loss, loss_kwargs=loss_kwargs, lr=lr, bias=False, dtype=dtype,
                                     tf32=tf32, device=device, generator=torch.Generator().manual_seed(0),
                                     **app_head_kwargs(loss))
    out = {"float64": make(torch.float64, False)}
    for name, (dtype, tf32) in PRECISIONS.items():
        out[name] = make(dtype, tf32)
        out[name].reset_weight(out["float64"].weight().to(dtype))
    return out


def drift(loss: str, D: int, d: int, m: int, steps: int, every: int, device: torch.device) -> list[dict]:
    hs = heads(loss, D, d, device)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        H = torch.randn(m, d, generator=g, dtype=torch.float64).to(device)
        idx = zipf_targets(m, D, g, device)
        for h in hs.values():
            h.train_step(H.to(h.dtype), idx)
        if step % every == 0 or step == steps:
            for h in hs.values():
                h.sync()
            ref = hs["float64"].weight()
            for name in PRECISIONS:
                gap = float((hs[name].weight().double() - ref).norm() / ref.norm())
                rows.append({"device": device.type, "loss": loss, "precision": name, "D": D, "d": d, "m": m,
                             "step": step, "rel_w": gap})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=int, default=10_000)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--loss", nargs="+", default=["zloss", "sampled"], choices=["zloss", "sampled"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (the test suite)")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.D, args.d, args.m, args.steps, args.every = 300, 16, 32, 6, 3
    rows = []
    for loss in args.loss:
        rows += drift(loss, args.D, args.d, args.m, args.steps, args.every, torch.device(args.device))
        last = {r["precision"]: r["rel_w"] for r in rows if r["loss"] == loss and r["step"] == args.steps}
        print(f"loss={loss}: W's gap to float64 after {args.steps} steps: float32 {last['float32']:.2e}, "
              f"TF32 {last['tf32']:.2e}", flush=True)
    save_rows(args, output_dir(args, "tf32_drift"), "tf32_drift", rows, COLUMNS, argv)
    return rows


if __name__ == "__main__":
    main()
