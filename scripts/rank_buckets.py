"""Where a trained model's ranks come from, on the synthetic Zipf task: each validation
example split by what its target is and how frequent it is.

A synthetic example's target follows the rule (the last context token XOR 1) with
probability ``p_rule``, else it is a fresh Zipf draw (data/synthetic.py). A model can learn
the rule for the classes it has seen often enough; a fresh draw it can only rank by the
classes' prior, their frequency. Class ids are frequency ranks, so the buckets are
decades of the target's id: rule / fresh x [0, 10), [10, 100), ... For each bucket: the
examples, MRR, top-1 and top-10 error, from the run's own head (``target_rank``, as the
app's validation), and ``frequent_in_top10``: how many of the ten most frequent classes
(ids 0-9) the model's top 10 holds, on average. A fresh draw among those ten is missed when
the top 10 gives their places to other classes (a context's false positives).

    uv run python scripts/rank_buckets.py RUN_DIR [RUN_DIR ...] [--out DIR]

Each RUN_DIR is an ``lst-train`` run directory on ``data=synthetic`` with its checkpoint
(``checkpoints/last.ckpt``; the run's ``.hydra/config.yaml`` rebuilds the model). Prints a
markdown table per run and writes ``rank_buckets.csv`` (all runs) into ``--out`` or a fresh
run directory.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchlib import add_output_args, markdown_table, output_dir, write_csv, wrote

import torch
from omegaconf import OmegaConf

from lst_lightning.app.train import build

EDGES = [0, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000]
COLUMNS = ["run", "target", "ids", "examples", "mrr", "top1_error", "top10_error", "frequent_in_top10"]


def ranks_of(run_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rank, target, last context token, how many of ids 0-9 are in the top 10) of every
    validation example, from the run's checkpoint."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    if "synthetic" not in str(cfg.data._target_).lower():
        raise ValueError(f"{run_dir}: rank_buckets reads the synthetic task's rule; this run trained on "
                         f"{cfg.data._target_}")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        raise ValueError(f"{run_dir}: no checkpoints/last.ckpt (a run with +callbacks.checkpoint.enabled=false "
                         "keeps none)")
    with tempfile.TemporaryDirectory() as tmp:
        dm, module, _ = build(cfg, tmp)
    module.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
    module.eval()
    ranks, targets, last, frequent = [], [], [], []
    with torch.no_grad():
        for context, target in dm.val_dataloader():
            hidden = module(context)
            ranks.append(module.head.target_rank(hidden, target, module.score_chunk_size))
            top = module.head.topk(hidden, 10, module.score_chunk_size)[1]
            frequent.append((top < 10).sum(1))
            targets.append(target)
            last.append(context[:, -1])
    return torch.cat(ranks).double(), torch.cat(targets), torch.cat(last), torch.cat(frequent).double()


def bucket_rows(name: str, rank: torch.Tensor, target: torch.Tensor, last: torch.Tensor,
                frequent: torch.Tensor) -> list[dict]:
    """One row for all the examples, then one per (rule or fresh, decade of the target's id)
    that has any. ``frequent``: per example, how many of ids 0-9 its top 10 holds."""
    def row(kind: str, ids: str, sel: torch.Tensor) -> dict:
        r = rank[sel]
        return dict(run=name, target=kind, ids=ids, examples=int(sel.sum()), mrr=round(float((1 / r).mean()), 4),
                    top1_error=round(float((r > 1).double().mean()), 4),
                    top10_error=round(float((r > 10).double().mean()), 4),
                    frequent_in_top10=round(float(frequent[sel].mean()), 2))

    rule = target == (last ^ 1)
    rows = [row("all", "all", torch.ones_like(rule))]
    for kind, sel in (("rule", rule), ("fresh", ~rule)):
        for lo, hi in zip(EDGES, EDGES[1:]):
            here = sel & (target >= lo) & (target < hi)
            if here.any():
                rows.append(row(kind, f"[{lo:,}, {hi:,})", here))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="lst-train run directories (synthetic task, with a checkpoint)")
    add_output_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for run_dir in args.runs:
        here = bucket_rows(run_dir.name, *ranks_of(run_dir))
        print(f"\n{run_dir}\n\n{markdown_table(here, COLUMNS[1:])}", flush=True)
        rows += here
    path = output_dir(args, "rank_buckets") / "rank_buckets.csv"
    write_csv(path, rows, COLUMNS)
    wrote(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
