"""Run the training app once per head (same body, data and steps, side by side in one
process) and compare tokens/s, the head's share of step time and the final metrics.

    uv run python scripts/compare_heads_app.py --heads factored naive --steps 300 \
        -- data.vocab_size=10000

Writes ``benchmarks/results/app_heads_<machine>.csv`` and a plot next to it, and prints
the ratios of tokens/s to the first head's.
"""
from __future__ import annotations

import argparse
import csv
import platform
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from lst_lightning.app.train import config_dir, run


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "_")
    return f"{platform.processor() or platform.machine()}_{torch.get_num_threads()}threads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=["factored", "naive"])
    ap.add_argument("--loss", default="zloss")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    rows = []
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"), tempfile.TemporaryDirectory() as tmp:
        for head in args.heads:
            cfg = compose("config", overrides=[
                f"head={head}", f"loss={args.loss}", "logger=csv", "callbacks=minimal", "test=false",
                f"trainer.limit_train_batches={args.steps}", *args.overrides])
            res = run(cfg, Path(tmp) / head)
            rows.append({"head": head, "loss": args.loss, "num_classes": res["num_classes"],
                         "steps": res["train_steps"], "tokens_per_s": res["tokens_per_s"],
                         "step_time_ms": res["step_time_ms"], "head_share": res["head_share"],
                         "val_mrr": res["val"]["mrr"], "val_top10_error": res["val"]["top10_error"],
                         "machine": machine()})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base
        print(f"{r['head']:>12}: {r['tokens_per_s']:9.0f} tokens/s  x{r['tokens_per_s_ratio']:.2f}  "
              f"head share {r['head_share']:.2f}  val MRR {r['val_mrr']:.4f}")
    out = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"app_heads_{machine()}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["head"] for r in rows]
    ax[0].bar(names, [r["tokens_per_s"] for r in rows])
    ax[0].set_ylabel("tokens/s")
    ax[1].bar(names, [r["head_share"] for r in rows])
    ax[1].set_ylabel("head's share of step time")
    fig.suptitle(f"lst-train, D={rows[0]['num_classes']}, {machine()}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
