"""A run's record beyond its metrics (names: app/run_keys.py): its facts, logged as
hyperparameters to every logger when the trainer is set up (the W&B config, the CSV
logger's hparams.yaml), and at the end its results as the W&B run's summary, after which
the W&B run is finished.

Finishing matters in a Hydra multirun: the jobs share one process, and Lightning's
``WandbLogger`` reuses a W&B run still in progress, so without it every job after the
first logged into the first job's run. A run that fails is finished with exit code 1."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger

from ...heads.base import OutputHead
from ..machine import machine_name
from ..run_keys import FACTS, summary_of


def run_facts(head: OutputHead, body: torch.nn.Module, batch_size: int, loss: str | None, loss_kwargs: dict,
              lr: float, gpu: bool, head_lr: float | None = None) -> dict:
    """The facts of ``run_keys.FACTS`` for a run of ``head`` on ``body`` (``head_lr``: an
    ordinary head's own optimiser lr, ``optimizer.head_lr``, when it has one)."""
    name = type(head).__name__
    zloss = loss == "zloss"
    facts = {
        "head": name, "loss": loss, "head_loss": f"{name}-{loss}" if loss else name,
        "a": loss_kwargs.get("a") if zloss else None, "b": loss_kwargs.get("b") if zloss else None,
        "lr": lr, "head_lr": float(head.lr) if head.self_updating else head_lr,
        "D": int(head.num_classes), "d": int(head.hidden_dim), "m": int(batch_size),
        "body": type(body).__name__, "machine": machine_name(gpu),
    }
    return {k: facts[k] for k in FACTS}


class RunRecord(pl.Callback):
    def __init__(self, facts: dict):
        self.facts = dict(facts)

    def setup(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.facts)

    def finish(self, trainer, results: dict) -> None:
        """The results as the W&B runs' summary; then the W&B runs end."""
        for run in self._wandb_runs(trainer):
            run.summary.update(summary_of(results))
            run.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        for run in self._wandb_runs(trainer):
            run.finish(exit_code=1)

    @staticmethod
    def _wandb_runs(trainer):
        if not trainer.is_global_zero:
            return []
        return [lg.experiment for lg in trainer.loggers if isinstance(lg, WandbLogger)]
