"""The console's progress bar: Lightning's rich bar, with the epoch shown without a cap where the
epochs have none (a run for a fixed time: "Epoch 3", not "Epoch 3/-2") and the time budget's
training time left beside the metrics."""
from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar

from .progress_log import clock
from .time_budget import budget_timer


class ProgressBar(RichProgressBar):
    """``RichProgressBar`` with the epoch's cap only where there is one and ``time left`` where the
    run has a time budget (``trainer.max_time``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            description = description.replace(f"/{self.trainer.max_epochs - 1}", "", 1)
        return description

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        budget = budget_timer(trainer)
        if budget is not None:
            items["time left"] = clock(max(budget.time_remaining(), 0.0))
        return items
