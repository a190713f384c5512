"""Run the training app once per head (same body, data and steps, side by side in one
process) and compare tokens/s, the head's share of step time and the final metrics.

    uv run python scripts/compare_heads_app.py --heads factored naive --steps 300 \
        -- data.vocab_size=10000

Writes ``app_heads_<machine>.csv`` and a plot next to it into a fresh run directory
(``--out DIR``; ``--update-results``: into benchmarks/results/), and prints the ratios of
tokens/s to the first head's.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import add_output_args, machine_name, output_dir, pyplot, save_figure, write_csv, wrote

from hydra import compose, initialize_config_dir

from lst_lightning.app.configs import config_dir
from lst_lightning.app.train import run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=["factored", "naive"])
    ap.add_argument("--loss", default="zloss")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    add_output_args(ap)
    args = ap.parse_args(argv)
    out = output_dir(args, "compare_heads_app")
    machine = machine_name()
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
                         "val_mrr": res["val"]["mrr"], "val_top10_error": res["val"]["top10_error"]})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base
        print(f"{r['head']:>12}: {r['tokens_per_s']:9.0f} tokens/s  x{r['tokens_per_s_ratio']:.2f}  "
              f"head share {r['head_share']:.2f}  val MRR {r['val_mrr']:.4f}")
    stem = out / f"app_heads_{machine}"
    fig, ax = pyplot().subplots(1, 2, figsize=(9, 3.5))
    names = [r["head"] for r in rows]
    ax[0].bar(names, [r["tokens_per_s"] for r in rows])
    ax[0].set_ylabel("tokens/s")
    ax[1].bar(names, [r["head_share"] for r in rows])
    ax[1].set_ylabel("head's share of step time")
    fig.suptitle(f"lst-train, D={rows[0]['num_classes']}, {machine}")
    fig.tight_layout()
    wrote(write_csv(stem.with_suffix(".csv"), rows, machine=machine), save_figure(fig, stem.with_suffix(".png")))


if __name__ == "__main__":
    main()
