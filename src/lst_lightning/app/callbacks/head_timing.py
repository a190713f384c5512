"""The time of a training step and the output head's share of it, measured every few
steps with hooks on the head (forward, and the gradient it hands to the body), so that
the LightningModule needs no timing code of its own."""
from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from torch import nn

from ...heads.base import OutputHead


def find_head(pl_module: nn.Module) -> OutputHead:
    """The module's one output head."""
    heads = [m for m in pl_module.modules() if isinstance(m, OutputHead)]
    if len(heads) != 1:
        raise ValueError(f"{type(pl_module).__name__} holds {len(heads)} output heads; this callback needs exactly one")
    return heads[0]


class HeadTiming(pl.Callback):
    """Every ``every``-th step: logs ``train/step_ms``, ``train/tokens_per_s`` and
    ``train/head_share`` (head forward + the head's part of backward, over the step).
    ``totals`` sums them over the timed steps after the first two periods (warm-up).
    On CUDA the timed steps synchronise the device; the others run untouched."""

    def __init__(self, every: int = 10):
        if not (isinstance(every, int) and every >= 0):
            raise ValueError(f"timing_every must be an int >= 0 (0: off), got {every!r}")
        self.every = every
        self.totals = {"steps": 0, "step_s": 0.0, "head_s": 0.0, "tokens": 0}
        self._marks: dict[str, float] = {}
        self._timed = False
        self._rows = 0
        self._device = torch.device("cpu")
        self._hooks: list = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self.every and not self._hooks:
            head = find_head(pl_module)
            self._hooks = [head.register_forward_pre_hook(self._before_head),
                           head.register_forward_hook(self._after_head)]

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _now(self, key: str) -> None:
        if self._timed:
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._marks[key] = time.perf_counter()

    def _before_head(self, head, args) -> None:
        if not (self._timed and head.training):
            return
        self._now("hidden")
        hidden = args[0]
        self._rows = hidden.shape[0]  # the tokens of the step (a sequence body's positions too)
        if torch.is_grad_enabled() and hidden.requires_grad:
            hidden.register_hook(self._at_head_grad)

    def _at_head_grad(self, grad) -> None:
        self._now("head_grad")  # the head's backward is done: the body's begins

    def _after_head(self, head, args, out) -> None:
        if self._timed and head.training:
            self._now("loss")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._timed = self.every > 0 and trainer.global_step % self.every == 0
        self._device = pl_module.device
        self._now("start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._now("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._timed:
            return
        self._now("end")
        m, self._marks, self._timed = self._marks, {}, False
        if not {"hidden", "loss", "backward", "head_grad"} <= m.keys():
            return
        step = m["end"] - m["start"]
        head = (m["loss"] - m["hidden"]) + (m["head_grad"] - m["backward"])
        n = self._rows
        pl_module.log("train/tokens_per_s", n / step, prog_bar=True)
        pl_module.log("train/head_share", head / step)
        pl_module.log("train/step_ms", 1e3 * step)
        if trainer.global_step >= 2 * self.every:  # skip warm-up steps in the totals
            t = self.totals
            t["steps"] += 1
            t["step_s"] += step
            t["head_s"] += head
            t["tokens"] += n
