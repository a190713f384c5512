"""A trained head's logit spread, and what it means for estimating the softmax normaliser from
sampled classes: with and without a control variate whose sum over all D classes is exact.

For each validation row h, over all D classes: the logits o_j, their mean mu and spread sigma
(standard deviation over the classes), how far the largest logit is above the mean
(``top_gap``) and the share of Z that the 10 largest classes hold (``top_mass``), and the relative standard deviation of the estimate of
Z = sum_j e^(o_j) from S classes drawn with replacement from a proposal q (uniform, or the
log-uniform proposal the default head draws from):

- plain: Z-hat = (1/S) sum_s e^(o_s) / q_s;
- Taylor control variate: T(o) = e^mu (1 + (o - mu) + (o - mu)^2 / 2), whose sum over all classes
  is exact from the mean and variance of the logits (in the factored head, from s = H wbar and
  q = diag(H Q H^T)); Z-hat = sum_j T(o_j) + (1/S) sum_s (e^(o_s) - T(o_s)) / q_s.

The standard deviations are exact for the given logits (computed over all D, not sampled). The
control variate pays where sigma is small (at sigma = 0.5 it cut the relative standard deviation
about 6x on Gaussian logits); where Z is the tail's it buys nothing.

    uv run python scripts/logit_spread.py RUN_DIR [RUN_DIR ...] [--rows 256] [--S 512] [--out DIR]

Each RUN_DIR is an ``lst-train`` run directory with ``checkpoints/last.ckpt`` (a factored head).
Writes ``logit_spread.csv`` (a row per run and proposal) into ``--out`` or a fresh folder.
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

from benchlib import add_output_args, markdown_table, output_dir, provenance, wrote

import torch
from omegaconf import OmegaConf

from lst_lightning.app.train import build

COLUMNS = ["run", "D", "rows", "S", "proposal", "sigma_median", "sigma_p10", "sigma_p90", "top_gap_median",
           "top_mass_median", "rel_sd_plain",
           "rel_sd_taylor", "machine", "torch", "commit", "date", "command"]


def proposals(D: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(D, dtype=torch.float64)
    log_uniform = torch.log1p(1.0 / (ids + 1.0))  # Zipf over frequency-ranked ids, as the default draws
    return {"uniform": torch.full((D,), 1.0 / D, dtype=torch.float64), "log_uniform": log_uniform / log_uniform.sum()}


def relative_sds(o: torch.Tensor, q: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits ``o`` (m, D), float64: (sigma, the plain estimate's relative sd, the
    control variate's), for S draws from ``q``."""
    mu = o.mean(1, keepdim=True)
    var = o.var(1, unbiased=False, keepdim=True)
    top = o.max(1, keepdim=True).values  # everything relative to e^top: no overflow
    e = torch.exp(o - top)
    Z = e.sum(1)
    t = torch.exp(mu - top) * (1 + (o - mu) + (o - mu) ** 2 / 2)

    def rel_sd(x: torch.Tensor) -> torch.Tensor:  # sd of (1/S) sum x_s / q_s over draws s ~ q
        total = x.sum(1)
        second = (x ** 2 / q).sum(1)
        return torch.sqrt((second - total ** 2).clamp(min=0) / S) / Z

    return var.sqrt().squeeze(1), rel_sd(e), rel_sd(e - t)


def spread_rows(run_dir: Path, rows: int, S: int) -> list[dict]:
    hydra = run_dir / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(hydra if hydra.is_file() else run_dir / "config.yaml")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise ValueError(f"{run_dir}: no checkpoints/last.ckpt")
    with tempfile.TemporaryDirectory() as tmp:
        dm, module, _ = build(cfg, tmp)
    module.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
    module.eval()
    hidden = []
    with torch.no_grad():
        for context, _ in dm.val_dataloader():
            hidden.append(module(context))
            if sum(len(h) for h in hidden) >= rows:
                break
    H = torch.cat(hidden)[:rows]
    D = module.head.num_classes
    out = []
    sig, plain, taylor = {}, {}, {}
    for name, q in proposals(D).items():
        s_all, p_all, t_all, gaps, masses = [], [], [], [], []
        for chunk in H.split(32):
            with torch.no_grad():
                o = module.head.scores(chunk).double()
            s, p, t = relative_sds(o, q, S)
            s_all.append(s), p_all.append(p), t_all.append(t)
            gaps.append(o.max(1).values - o.mean(1))
            masses.append(torch.softmax(o, 1).topk(10, 1).values.sum(1))  # the 10 largest classes' share of Z
        sig[name], plain[name], taylor[name] = torch.cat(s_all), torch.cat(p_all), torch.cat(t_all)
        sg = sig[name]
        out.append({"run": run_dir.name, "D": D, "rows": len(H), "S": S, "proposal": name,
                    "sigma_median": round(float(sg.median()), 3), "sigma_p10": round(float(sg.quantile(0.1)), 3),
                    "sigma_p90": round(float(sg.quantile(0.9)), 3),
                    "top_gap_median": round(float(torch.cat(gaps).median()), 2),
                    "top_mass_median": round(float(torch.cat(masses).median()), 3),
                    "rel_sd_plain": round(float(plain[name].median()), 4),
                    "rel_sd_taylor": round(float(taylor[name].median()), 4),
                    **provenance_of_run()})
    return out


def provenance_of_run() -> dict:
    return {**provenance(), "command": "uv run python scripts/logit_spread.py " + " ".join(sys.argv[1:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--rows", type=int, default=256, help="validation rows")
    p.add_argument("--S", type=int, default=512, help="sampled classes")
    add_output_args(p)
    args = p.parse_args(argv)
    out = output_dir(args, "logit_spread")
    rows = [r for run in args.runs for r in spread_rows(run, args.rows, args.S)]
    print(markdown_table(rows, COLUMNS[:-5], right=COLUMNS[1:-5]))
    path = out / "logit_spread.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    wrote(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
