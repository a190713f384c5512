"""When a self-updating head takes its step, and with which loss scale
(docs/training_loop.md).

By default the head steps inside the backward of each training forward. Attached to
an optimizer (``head.attach(optimizer, scaler)``) it steps at that optimizer's step
instead: each backward hands dL/dH on and keeps the micro-batch's rows (H, targets and
the m-sized loss gradients, all computed with the same W, which does not change before
the step), and the optimizer's step applies ONE exact update for all of them: exact
gradient accumulation. A ``GradScaler``'s scale is divided out of the head's step, and
when the scaler skips the optimizer's step (non-finite gradients) the head's kept rows
are dropped at the next backward (the scaler lowered its scale), so the head skips too.

Each forward steps the head at most once: a second backward through the same forward
(``torch.autograd.grad(L, params, retain_graph=True)`` for a gradient norm, then
``L.backward()``) hands on the same dL/dH and takes no second step. In ``eval()`` mode
the head is frozen: its loss still gives the body dL/dH, and the head does not change.
"""
from __future__ import annotations

import math
import warnings
import weakref

import torch
from torch import Tensor

#: Default bound on the rows a head keeps between optimizer steps (memory: about
#: rows x (d + 3 + 2K) values of the head's dtype).
MAX_PENDING_ROWS = 1 << 20


class _ForwardToken:
    """One training forward: whether its backward ran, and the dL/dH it handed on."""

    __slots__ = ("__weakref__", "dH", "grad")

    def __init__(self):
        self.dH: Tensor | None = None
        self.grad: Tensor | None = None


class PendingSteps:
    """When the step is taken and the loss scale, as methods of the spherical heads.

    A head class provides ``_hidden_grad(saved, grad)`` (dL/dH, no change of state),
    ``_pending_record(saved, weight)`` (what one micro-batch keeps) and
    ``_apply_records(records)`` (the one exact step on all of them)."""

    def _init_pending_steps(self) -> None:
        #: The loss scale the backward's gradient carries when no scaler is attached
        #: (a user's loop sets it: ``head.loss_scale = scaler.get_scale()``).
        self.loss_scale = 1.0
        self.max_pending_rows = MAX_PENDING_ROWS
        self.scaler_skips = 0  # steps dropped because the attached GradScaler skipped its step
        self._optimizer = self._hook = self._scaler = None
        self._records: list = []
        self._records_scale: float | None = None
        self._pending_rows = 0
        self._open = None  # weakref to the token of the last training forward
        self._warned: set[str] = set()

    # -- settings -------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"loss_scale must be finite and positive, got {value}")
        self._loss_scale = value

    @property
    def max_pending_rows(self) -> int:
        return self._max_pending_rows

    @max_pending_rows.setter
    def max_pending_rows(self, value: int) -> None:
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"max_pending_rows must be a positive int, got {value!r}")
        self._max_pending_rows = value

    @property
    def attached(self) -> bool:
        """Whether the head steps at an optimizer's step (else in each backward)."""
        return self._hook is not None

    @property
    def pending_rows(self) -> int:
        """Rows kept for the next optimizer step."""
        return self._pending_rows

    def attach(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None,
               max_pending_rows: int | None = None) -> None:
        """Step the head at ``optimizer``'s step, with ``scaler``'s scale divided out (and no
        step when the scaler skips). Several backward passes before one optimizer step
        accumulate exactly: one step on all their rows. Call ``detach()`` to undo."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        why = self.cannot_accumulate()
        if why:
            raise ValueError(f"{type(self).__name__} cannot wait for the optimizer's step: {why}")
        if max_pending_rows is not None:
            self.max_pending_rows = max_pending_rows
        self.detach()
        self._optimizer, self._scaler = optimizer, scaler
        self._hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: self.apply_pending_step())

    def detach(self) -> None:
        """Step in each backward again; rows kept for a step not taken are dropped."""
        if self._hook is not None:
            self._hook.remove()
        self._optimizer = self._hook = self._scaler = None
        self.discard_pending_step()

    def discard_pending_step(self) -> None:
        self._records, self._records_scale, self._pending_rows = [], None, 0

    def current_loss_scale(self) -> float:
        """The scale in the backward's gradient: the attached scaler's, else ``loss_scale``."""
        if self._scaler is not None and self._scaler.is_enabled():
            return float(self._scaler.get_scale())
        return self._loss_scale

    @torch.no_grad()
    def apply_pending_step(self) -> None:
        """The one exact step on every row kept since the last one (the optimizer's step
        hook calls it; a loop may call it itself). Nothing kept: nothing happens."""
        if not self._records:
            return
        records = self._records
        self.discard_pending_step()
        with torch.autocast(self.device.type, enabled=False):  # the head's math in its own dtype
            self._apply_records(records)

    # -- the hooks of forward and backward ------------------------------------------------
    def _open_forward(self, rows: int) -> _ForwardToken:
        """Checks before a training forward, raised before any change; its token."""
        name = type(self).__name__
        last = self._open() if self._open is not None else None
        if not self.attached and last is not None and last.dH is None:
            raise RuntimeError(
                f"{name}: a second training forward while the last one's loss is still alive and has not been "
                "backpropagated. The head steps in backward, so each forward needs its own backward before the "
                "next forward: call backward, or drop (or detach) the old loss; to accumulate gradients over "
                "several forwards, attach the head to the optimizer (head.attach(optimizer)).")
        if self.attached and self._pending_rows + rows > self.max_pending_rows:
            raise ValueError(
                f"{name}: {self._pending_rows} rows kept for the next optimizer step plus {rows} would exceed "
                f"max_pending_rows={self.max_pending_rows}: raise head.max_pending_rows or step the optimizer "
                "more often (fewer accumulated micro-batches)")
        token = _ForwardToken()
        self._open = weakref.ref(token)
        return token

    def _backward_of(self, saved, token: _ForwardToken | None, version: int, grad: Tensor) -> Tensor:
        """dL/dH for the backward of one forward; takes or keeps the head's step."""
        name = type(self).__name__
        if token is None:  # eval mode: a frozen head
            self._warn_once("eval", f"{name} is in eval mode: its loss gives the body dL/dH but the head takes "
                                    "no step (call .train() on it to train it)")
            return self._hidden_grad(saved, grad)
        if token.dH is not None:  # the same forward's second backward
            self._warn_once("again", f"{name}: a second backward through the same forward (autograd.grad for a "
                                     "gradient norm, retain_graph=True?) hands on the same dL/dH; the head took "
                                     "its step at the first backward and takes no other")
            return token.dH * (grad / token.grad) if bool(token.grad != 0) else torch.zeros_like(token.dH)
        if self._version != version:
            raise RuntimeError(
                f"{name}: its state changed between this forward and its backward "
                "(another step, a repair or a reset ran in between). The head applies its SGD step "
                "in backward, so each forward must be followed by its own backward.")
        scale = self.current_loss_scale()
        if self.attached:
            if self._records and self._scaler is not None and scale != self._records_scale:
                # the scaler lowered its scale: it skipped the optimizer's step these rows waited for
                self.scaler_skips += 1
                self.discard_pending_step()
            dH = self._hidden_grad(saved, grad)
            record = self._pending_record(saved, grad / scale)
            self._records.append(record)
            self._records_scale = scale
            self._pending_rows += dH.shape[0]
        else:
            if not self.deferred_checks and "weight" not in self._warned and grad.numel() == 1 \
                    and float(grad) != scale:
                self._warn_once("weight", f"{name}: the loss reached the head multiplied by {float(grad) / scale:g} "
                                          "and the head stepped with that factor. If this is gradient accumulation "
                                          "or a loss scaler, attach the head to the optimizer (head.attach(optimizer, "
                                          "scaler); Lightning: the HeadSteps callback) for one exact step")
            dH = self._backward_step(saved, grad / scale)
            if scale != 1.0:
                dH = dH * scale
        token.dH, token.grad = dH, grad
        return dH

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)
