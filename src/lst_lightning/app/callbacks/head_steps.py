"""Self-updating heads step at Lightning's optimizer step: exact gradient accumulation
(``accumulate_grad_batches``) and the unscaled step, skipped with the optimizer's,
under a ``GradScaler`` (``precision="16-mixed"``); their device flags are read at the end of
training. Works with any LightningModule that holds spherical
heads; the app's ``LanguageModel`` adds it itself."""
from __future__ import annotations

import lightning.pytorch as pl
import torch

from ...spherical import SphericalHeadBase


def grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The precision plugin's loss scaler (``16-mixed``), if any."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


class HeadSteps(pl.Callback):
    """Attach every self-updating head of the module to the (one) optimizer at the start of
    training when steps accumulate or a scaler scales the loss; detach at the end, and when
    training raises (the rows kept for a step that will not come are dropped). A head
    that cannot wait for the optimizer (``step="fused"``) is refused then, before any step,
    with the reason. Every head's device flags are read at the end of training
    (``head.sync(repair=False)``: a report, no repair, since a run's state must not depend on
    where it stopped): a bad batch since the last read raises there, naming its step."""

    def __init__(self):
        self._heads: list[SphericalHeadBase] = []

    @staticmethod
    def _all_heads(pl_module: pl.LightningModule) -> list[SphericalHeadBase]:
        return [m for m in pl_module.modules() if isinstance(m, SphericalHeadBase)]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        heads = self._all_heads(pl_module)
        scaler = grad_scaler(trainer)
        accumulate = trainer.accumulate_grad_batches
        if not heads or (accumulate == 1 and scaler is None):
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(f"a self-updating head steps with the optimizer: {len(trainer.optimizers)} "
                             "optimizers leave it ambiguous; use one optimizer")
        why = f"accumulate_grad_batches={accumulate}" if accumulate > 1 else "a loss scaler (16-mixed)"
        for head in heads:
            try:
                head.attach(trainer.optimizers[0], scaler)
            except ValueError as e:
                raise ValueError(f"{why} needs the head to step at the optimizer's step: {e}") from None
        self._heads = heads

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:  # the flags of the last steps read: a bad batch among them raises from fit() (no repair:
            for head in self._all_heads(pl_module):  # the state must not depend on where a run stopped)
                head.sync(repair=False)
        finally:
            self._detach()

    def _detach(self) -> None:
        for head in self._heads:
            head.detach()
        self._heads = []

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()
