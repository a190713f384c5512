"""Exact accumulation: the rows a self-updating head keeps for the optimizer step that owns
them (``head.pending``; docs/training_loop.md). Unattached, the head steps in the backward of
each training forward and never calls this object. Attached (``head.attach(optimizer, scaler)``),
each backward hands dL/dH on and keeps the micro-batch's rows (H, targets and the m-sized loss
gradients, all made with the same W, which does not move before the step), and the optimizer's
step applies ONE exact update for all of them. A ``GradScaler``'s scale is divided out, and when
the scaler skips the optimizer's step the kept rows are dropped at the next backward (the scaler
lowered its scale), so the head skips too.

So that a head never stops stepping silently when a loop raises inside its accumulation window
(leaving rows no step will take): with ``attach(..., accumulate=N)`` (the Hugging Face and
Lightning integrations pass theirs) a training forward that finds N micro-batches kept and no
step since raises, with the fix in its one line; the optimizer is held weakly, and once it is
gone the next training forward drops the rows with a warning and detaches the head; Lightning's
``HeadSteps`` callback detaches the head when training raises.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..heads.user_warning import warn
from .precision import own_math
from .settings import positive_int

#: Default bound on the rows a head keeps between optimizer steps (memory: about
#: rows x (d + 3 + 2K) values of the head's dtype).
MAX_PENDING_ROWS = 1 << 20


def wrapper_scaler(wrapper) -> torch.amp.GradScaler | None:
    """The GradScaler an optimizer wrapper steps with: accelerate's ``.scaler``, else its strategy's
    precision's (Fabric's ``fabric.strategy.precision.scaler``, Lightning's LightningOptimizer's
    ``trainer.strategy.precision_plugin.scaler``), else None."""
    strategy = getattr(wrapper, "_strategy", None)
    precision = getattr(strategy, "precision", None) or getattr(strategy, "precision_plugin", None)
    return getattr(wrapper, "scaler", None) or getattr(precision, "scaler", None)


class PendingRows:
    """The rows kept for the attached optimizer's next step, the loss scale, and the checks
    of an accumulation window. The head provides ``_hidden_grad(saved, grad)`` (dL/dH, no
    change of state), ``_pending_record(saved, weight, m)`` (what one micro-batch of m rows keeps) and
    ``_apply_records(records)`` (the one exact step on all of them)."""

    def __init__(self):
        #: the loss scale the backward's gradient carries when no scaler is attached
        self.loss_scale = 1.0
        self.max_rows = MAX_PENDING_ROWS
        self.scaler_skips = 0  # steps dropped because the attached GradScaler skipped its step
        self.optimizer: weakref.ref | None = None
        self.hook = self.scaler = None
        self.accumulate: int | None = None  # micro-batches per optimizer step, when known
        self.records: list = []
        self.records_scale: float | None = None
        self.rows = 0

    def attach(self, head, optimizer: torch.optim.Optimizer, scaler=None, max_pending_rows: int | None = None,
               accumulate: int | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__} (in "
                            "Lightning, the HeadSteps callback attaches the head: from lst_lightning.app.callbacks "
                            "import HeadSteps)")
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            # a wrapper (accelerate's AcceleratedOptimizer, Fabric's) steps the optimizer it wraps on the
            # steps it takes (not inside an accumulation window, not when its scaler skips)
            optimizer, scaler = inner, scaler if scaler is not None else wrapper_scaler(optimizer)
        if not hasattr(optimizer, "_optimizer_step_post_hooks"):
            raise TypeError(f"attach() needs an optimizer with torch's step hooks: {type(optimizer).__name__} did not "
                            "run torch.optim.Optimizer.__init__ (attach the optimizer it wraps)")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        positive_int("accumulate", optional=True)(accumulate)
        why = head.cannot_accumulate()
        if why:
            raise ValueError(f"{type(head).__name__} cannot wait for the optimizer's step: {why}")
        if max_pending_rows is not None:
            head.max_pending_rows = max_pending_rows
        self.detach()
        self.optimizer, self.scaler, self.accumulate = weakref.ref(optimizer), scaler, accumulate
        self.hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: head.apply_pending_step())

    def detach(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        self.optimizer = self.hook = self.scaler = self.accumulate = None
        self.discard()

    def discard(self) -> None:
        self.records, self.records_scale, self.rows = [], None, 0

    def scale(self) -> float:
        if self.scaler is not None and self.scaler.is_enabled():
            return float(self.scaler.get_scale())
        return self.loss_scale

    def _scaler_skipped(self) -> bool:
        """The scaler lowered its scale since these rows were kept: it skipped their step."""
        return bool(self.records) and self.scaler is not None and self.scale() != self.records_scale

    def open(self, head, rows: int) -> None:
        """The checks of a training forward while attached, raised before any change; a head
        whose optimizer is gone is detached (with a warning when rows were dropped)."""
        name = type(head).__name__
        if self.optimizer() is None:
            if self.records:
                warn(f"{name}: the optimizer it was attached to is gone before its step: the {self.rows} rows kept "
                     "for that step were dropped, and the head steps in each backward again (attach it to the new "
                     "optimizer to accumulate)")
            self.detach()
            return
        if self.accumulate is not None and len(self.records) >= self.accumulate and not self._scaler_skipped():
            raise RuntimeError(
                f"{name}: {len(self.records)} micro-batches ({self.rows} rows) kept for an optimizer step that has "
                f"not come (accumulate={self.accumulate}): a training loop raised inside its accumulation window? "
                "call head.detach() to drop them and step in each backward (or head.attach(optimizer) again); a loop "
                "that skips an optimizer step on purpose calls head.discard_pending_step() where it zeroes the gradients")
        if self.rows + rows > self.max_rows:
            raise ValueError(
                f"{name}: {self.rows} rows kept for the next optimizer step plus {rows} would exceed "
                f"max_pending_rows={self.max_rows}: raise head.max_pending_rows or step the optimizer "
                "more often (fewer accumulated micro-batches)")

    def keep(self, head, saved, grad: Tensor, m: int) -> Tensor:
        """The backward of a micro-batch of ``m`` rows while attached: dL/dH now, its rows kept for
        the step."""
        scale = self.scale()
        if grad.numel() == 1 and "weight" not in head._warned:
            # a micro-batch's share of the window's loss, times the processes where the loss is the
            # world's mean (the HF Trainer's average_tokens_across_devices): more is a loss scaler not attached
            most = scale * head.processes.world
            factor = getattr(head, "_loss_factor", None)  # the factored head's: warned at the flags' read
            if factor is not None:
                factor.copy_(torch.where(grad > most, grad.to(torch.float64) / scale, factor))
            elif float(grad) > most:
                head._warn_loss_factor(float(grad) / scale)  # the naive head's: at once
        if self._scaler_skipped():
            self.scaler_skips += 1
            self.discard()
        dH = head._hidden_grad(saved, grad)
        self.records.append(head._pending_record(saved, grad / scale, m))
        self.records_scale = scale
        self.rows += self.records[-1][1].shape[0]  # the batch's own rows (a padded step's record drops its padding)
        return dH

    @torch.no_grad()
    def apply(self, head) -> None:
        """The one exact step on every row kept since the last one. Nothing kept: nothing happens."""
        if not self.records:
            return
        records = self.records
        self.discard()
        with own_math(head.device.type, head.tf32):  # the head's math in its own dtype and precision
            head._apply_records(records)

