"""How far bf16 mixed precision moves the trained head from fp32 training: the relative
difference ||W_bf16 - W_fp32|| / ||W_fp32|| of the head's W (and of the body's parameters)
after N steps from the same seed and data, for the factored and the naive spherical head,

- in a plain user LightningModule (an embedding + MLP body, the head on top,
  ``Trainer(precision="bf16-mixed")``: autocast around the forward), and
- through ``lst-train`` (``trainer.precision=bf16-mixed``, the tiny experiment), W read
  back from the run's last checkpoint.

    uv run python scripts/mixed_precision_drift.py --steps 200     # a run dir under outputs/bench/

Writes ``mixed_precision_drift_<machine>.csv`` and ``.md`` (``--update-results``: into
benchmarks/results/).
"""
from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

# benchlib first: in a bare checkout it puts the package on the path.
from benchlib import add_output_args, machine_name, markdown_table, output_dir, write_csv, wrote

import lightning.pytorch as pl
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

HEADS = {"factored": FactoredSphericalHead, "naive": NaiveSphericalHead}
COLUMNS = ["route", "head", "loss", "steps", "rel_diff_W", "diff_over_update_W", "rel_diff_body",
           "final_loss_fp32", "final_loss_bf16"]


class UserModule(pl.LightningModule):
    """What a user writes: a body, the head as its output layer, Adam for the body only."""

    def __init__(self, head: torch.nn.Module, vocab: int, context: int, dim: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(context * dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = head
        self.losses: list[float] = []

    def training_step(self, batch, _):
        ctx, target = batch
        hidden = self.mlp(self.embed(ctx).flatten(1))
        loss = self.head(hidden, target)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam([p for n, p in self.named_parameters() if not n.startswith("head.")], lr=1e-3)


def toy_batches(steps: int, m: int, vocab: int, context: int, classes: int, seed: int):
    """A learnable next-token task: the target is a fixed function of the context, Zipf-ish ids."""
    g = torch.Generator().manual_seed(seed)
    ctx = (torch.rand(steps * m, context, generator=g) ** 3 * vocab).long()
    target = (ctx * torch.tensor([7, 13, 31][:context])).sum(1) % classes
    return list(zip(ctx.split(m), target.split(m)))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def train_user_module(head_name: str, loss: str, precision: str, steps: int, seed: int = 0, classes: int = 2000,
                      dim: int = 32, vocab: int = 500, context: int = 3, m: int = 64):
    """(W, W at the start, body parameters, final loss) after ``steps`` steps of the user module."""
    torch.manual_seed(seed)
    head = HEADS[head_name](classes, dim, loss=loss, lr=0.05, generator=torch.Generator().manual_seed(seed))
    W0 = head.weight()
    module = UserModule(head, vocab, context, dim)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = toy_batches(steps, m, vocab, context, classes, seed)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    body = torch.cat([p.detach().flatten() for n, p in module.named_parameters() if not n.startswith("head.")])
    return head.weight(), W0, body, sum(module.losses[-10:]) / len(module.losses[-10:])


def train_app(head_name: str, loss: str, precision: str, run_dir: Path):
    """(W, body parameters, steps) of a tiny ``lst-train`` run, read from its last checkpoint."""
    from hydra import compose, initialize_config_dir  # noqa: PLC0415

    from lst_lightning.app.configs import config_dir  # noqa: PLC0415
    from lst_lightning.app.train import run  # noqa: PLC0415

    over = ["experiment=tiny", "logger=csv", "callbacks=minimal", f"head={head_name}", f"loss={loss}",
            f"trainer.precision={precision}"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=over)
    res = run(cfg, run_dir)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    if head_name == "factored":
        W = state["head.V"] @ state["head.U"] + state["head.omega"]
    else:
        W = state["head.W"]
    body = torch.cat([v.flatten().double() for k, v in state.items()
                      if k.startswith("body.") and v.is_floating_point()])
    return W, body, res["train_steps"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps of the user module")
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--losses", nargs="+", default=["zloss", "spherical_softmax"])
    ap.add_argument("--routes", nargs="+", default=["user_module", "lst_train"], choices=["user_module", "lst_train"])
    add_output_args(ap)
    args = ap.parse_args(argv)
    out = output_dir(args, "mixed_precision_drift")
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    rows = []
    for route in args.routes:
        for head in args.heads:
            for loss in args.losses:
                if route == "user_module":
                    (W32, W0, b32, l32), (W16, _, b16, l16) = (train_user_module(head, loss, p, args.steps)
                                                               for p in ("32-true", "bf16-mixed"))
                    steps, moved = args.steps, f"{relative(W16 - W0, W32 - W0):.2e}"
                else:
                    with tempfile.TemporaryDirectory() as tmp:
                        (W32, b32, steps), (W16, b16, _) = (train_app(head, loss, p, Path(tmp) / p)
                                                            for p in ("32-true", "bf16-mixed"))
                    l32 = l16 = float("nan")
                    moved = ""
                rows.append({"route": route, "head": head, "loss": loss, "steps": steps,
                             "rel_diff_W": f"{relative(W16, W32):.2e}",
                             "diff_over_update_W": moved, "rel_diff_body": f"{relative(b16, b32):.2e}",
                             "final_loss_fp32": f"{l32:.4f}", "final_loss_bf16": f"{l16:.4f}"})
                print(rows[-1], flush=True)
    stem = out / f"mixed_precision_drift_{machine_name()}"
    write_csv(stem.with_suffix(".csv"), rows, COLUMNS)
    stem.with_suffix(".md").write_text(f"Machine: {machine_name()}\n\n"
                                       + markdown_table(rows, COLUMNS, right=COLUMNS[3:]) + "\n")
    wrote(stem.with_suffix(".csv"), stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
