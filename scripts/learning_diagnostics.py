"""Why a spherical head learns, or does not, as D grows: ``lst-train`` on the synthetic Zipf
task at each D and loss, with a probe of the head's outputs every few hundred steps.

At each probe, on 64 fixed held-out examples, over all D outputs o = W h (W with its bias
column): the spread sigma of the outputs, the share of their variance that the initial
random W still makes (var(W_0 h) / var(W h)), the bias column's share, the target's z-score
(o_t - mu) / sigma, how many classes stand at a z-score of at least the target's and of at
least 10, the largest z-score of a non-target, the size of dL/dh handed to the body, and
the target's rank. The validation MRR after training comes from the run itself.

    uv run python scripts/learning_diagnostics.py --sizes 10000 1000000 \\
        --losses zloss spherical_softmax --steps 2000 --probe-every 500
    uv run python scripts/learning_diagnostics.py --sizes 1000000 --losses zloss \\
        -o loss.kwargs.b=100 --tag b100        # any lst-train override

Writes ``learning_diagnostics_<tag>_<machine>.csv`` (a row per probe) and ``.md`` into a run
directory (``--out``; ``--update-results``: benchmarks/results/). docs/learning_at_scale.md
reads them.
"""
from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

from benchlib import add_output_args, machine_name, markdown_table, output_dir, write_csv, wrote

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir

from lst_lightning.app.configs import config_dir
from lst_lightning.app.train import run

PROBE_ROWS = 64
COLUMNS = ["tag", "loss", "D", "step", "sigma", "init_share", "bias_share", "z_target", "n_at_or_above_target",
           "n_z_above_10", "max_z_other", "grad_h_rms", "target_rank_median", "val_mrr"]


class OutputProbe(pl.Callback):
    """Statistics of the head's D outputs on a fixed held-out batch at the given steps (and 0)."""

    def __init__(self, every: int):
        self.every, self.rows, self.W0, self.batch = every, [], None, None

    def on_train_start(self, trainer, pl_module):
        context, target = next(iter(trainer.datamodule.val_dataloader()))
        self.batch = (context[:PROBE_ROWS], target[:PROBE_ROWS])
        self.W0 = pl_module.head.weight().clone()
        self.rows.append(self.probe(pl_module, 0))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            self.rows.append(self.probe(pl_module, step))

    @torch.no_grad()
    def outputs(self, head, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """O = W h, the initial W's part W_0 h, and the bias column's part (each (rows, D))."""
        Hx = head.augment(H).to(head.dtype)
        W = head.weight()
        bias = (W[:, -1] if head.bias else W.new_zeros(W.shape[0])).expand(H.shape[0], -1)
        return Hx @ W.T, Hx @ self.W0.T, bias

    def probe(self, pl_module, step: int) -> dict:
        head, was_training = pl_module.head, pl_module.training
        context, target = (t.to(pl_module.device) for t in self.batch)
        pl_module.eval()
        with torch.no_grad():
            H = pl_module.body(context).float()
        O, O0, bias = self.outputs(head, H)
        var = O.var(1, unbiased=False)
        sigma = var.sqrt()
        mu = O.mean(1)
        z = (O - mu[:, None]) / sigma[:, None]
        zt = z.gather(1, target[:, None])[:, 0]
        score = head.loss_fn.score(O)  # the model's own ranking
        st = score.gather(1, target[:, None])
        rank = (score > st).sum(1).float() + 1
        other = z.scatter(1, target[:, None], float("-inf"))
        # dL/dh for the body: the frozen head (eval mode) hands it on without stepping
        Hg = H.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            head(Hg, target).backward()
        grad = Hg.grad * H.shape[0]  # per row (the loss is a mean over the rows)
        pl_module.train(was_training)
        return {"step": step, "sigma": float(sigma.mean()),
                "init_share": float((O0.var(1, unbiased=False) / var).mean()),
                "bias_share": float((bias.var(1, unbiased=False) / var).mean()),
                "z_target": float(zt.mean()),
                "n_at_or_above_target": float((z >= zt[:, None]).sum(1).float().mean()),
                "n_z_above_10": float((z > 10).sum(1).float().mean()),
                "max_z_other": float(other.max(1).values.mean()),
                "grad_h_rms": float(grad.pow(2).sum(1).mean().sqrt()),
                "target_rank_median": float(rank.median())}


def run_one(loss: str, D: int, args, out: Path) -> list[dict]:
    overrides = ["data=synthetic", f"data.num_classes={D}", f"data.input_vocab_size={D}", f"loss={loss}",
                 f"trainer.max_steps={args.steps}", "test=false", "logger=csv", "callbacks=minimal",
                 f"seed={args.seed}", *args.override]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    probe = OutputProbe(args.probe_every)
    res = run(cfg, out / f"{args.tag}-{loss}-{D}", extra_callbacks=[probe])
    rows = [{"tag": args.tag, "loss": loss, "D": D, **r, "val_mrr": ""} for r in probe.rows]
    rows[-1]["val_mrr"] = res["val"]["mrr"]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    p.add_argument("--losses", nargs="+", default=["zloss", "spherical_softmax"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--probe-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="default", help="names this setting in the table")
    p.add_argument("-o", "--override", action="append", default=[], help="an lst-train override (repeatable)")
    add_output_args(p)
    args = p.parse_args(argv)
    out = output_dir(args, "learning_diagnostics")
    machine = machine_name()
    rows = []
    with tempfile.TemporaryDirectory() as runs:
        for D in args.sizes:
            for loss in args.losses:
                rows += run_one(loss, D, args, Path(runs))
                csv_path = out / f"learning_diagnostics_{args.tag}_{machine}.csv"
                write_csv(csv_path, rows, COLUMNS, append=False)
    fmt = [{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    md = out / f"learning_diagnostics_{args.tag}_{machine}.md"
    md.write_text(f"Machine: {machine}\n\n" + markdown_table(fmt, COLUMNS, right=COLUMNS[2:]) + "\n")
    wrote(csv_path, md)


if __name__ == "__main__":
    main()
