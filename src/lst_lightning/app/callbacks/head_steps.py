"""Self-updating heads step at Lightning's optimizer step: exact gradient accumulation
(``accumulate_grad_batches``, or a ``GradientAccumulationScheduler``'s) and the unscaled step,
skipped with the optimizer's, under a ``GradScaler`` (``precision="16-mixed"``); their device
flags are read at the end of training. Works with any LightningModule that holds spherical
heads; the app's ``LanguageModel`` adds it itself. Lightning's weight averaging of buffers
(``WeightAveraging``, ``EMAWeightAveraging``: ``use_buffers=True``, their default) over a factored
head is refused before any step (``check_weight_averaging``)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch

from ...spherical import FactoredSphericalHead, SphericalHeadBase

#: Lightning's callbacks that average a module's buffers where ``use_buffers`` (Lightning 2.6)
WEIGHT_AVERAGING = getattr(pl.callbacks, "WeightAveraging", ())


def grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The precision plugin's loss scaler (``16-mixed``), if any."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def most_accumulated(trainer: pl.Trainer) -> tuple[int, str]:
    """The most batches an optimizer step of this fit accumulates, and the setting that says so:
    ``accumulate_grad_batches``, or a ``GradientAccumulationScheduler``'s largest (it sets
    ``accumulate_grad_batches`` at each epoch's start, after training has started)."""
    most, why = trainer.accumulate_grad_batches, f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
    for cb in trainer.callbacks:
        if isinstance(cb, pl.callbacks.GradientAccumulationScheduler) and max(cb.scheduling.values()) > most:
            most, why = max(cb.scheduling.values()), f"GradientAccumulationScheduler({cb.scheduling})"
    return most, why


def check_weight_averaging(callbacks, heads) -> None:
    """One ValueError for a callback that averages a factored head's buffers: the average of its
    factors is no factored head (W = V U, U^-1 and Q = W^T W no longer hold, and the counters are
    averaged too), and such a callback writes it into the head at validation and at the end of
    training. With ``use_buffers=False`` the body's parameters are averaged and the head's buffers
    follow the trained head."""
    if not any(isinstance(h, FactoredSphericalHead) for h in heads):
        return
    for cb in callbacks:
        if isinstance(cb, WEIGHT_AVERAGING) and getattr(cb, "_use_buffers", True):
            raise ValueError(f"{type(cb).__name__} averages every buffer, and a factored head's state (V, U, U^-1, Q) "
                             "does not average: the mean of its factors breaks W = V U and Q = W^T W. Pass "
                             f"{type(cb).__name__}(use_buffers=False): the body is averaged and the head keeps its "
                             "trained state")


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

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_weight_averaging(trainer.callbacks, self._all_heads(pl_module))  # before the sanity check

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        heads = self._all_heads(pl_module)
        scaler = grad_scaler(trainer)
        accumulate, why = most_accumulated(trainer)
        if not heads or (accumulate == 1 and scaler is None):
            return
        if len(trainer.optimizers) != 1:
            raise ValueError(f"a self-updating head steps with the optimizer: {len(trainer.optimizers)} "
                             "optimizers leave it ambiguous; use one optimizer")
        why = why if accumulate > 1 else "a loss scaler (16-mixed)"
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
