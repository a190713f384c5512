"""The reference: an explicit D x d weight matrix, the loss on the full output,
autograd for every gradient, and a plain SGD step (with a right preconditioner P, the
step with dW P: preconditioner.py). O(m D d) per minibatch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..heads.targets import class_range
from .base import SphericalHeadBase
from .precision import own_precision
from .state import INPUT_MOMENTS, STEP_COUNTERS


class NaiveSphericalHead(SphericalHeadBase):
    """The constructor and API of ``FactoredSphericalHead`` without its factored-only
    settings (stabiliser, parallel, sync_every, step); W is a buffer (D, d[+1])."""

    def __init__(self, num_classes: int, hidden_dim: int, *args, **kwargs):
        super().__init__(num_classes, hidden_dim, *args, **kwargs)
        # The factored head's initial W for the same seed (drawn in blocks on the head's device).
        self.register_buffer("W", self._init_rows(0, num_classes, self._factory["device"]))
        for buf in STEP_COUNTERS + INPUT_MOMENTS:  # steps, skipped_nonfinite; the preconditioner's (state.py)
            self.register_buffer(buf.name, buf.initial(self))

    def weight(self) -> Tensor:
        return self.W.detach().clone()

    @torch.no_grad()
    def reset_weight(self, W: Tensor | None = None) -> None:
        if W is None:  # the head as constructed
            for buf in STEP_COUNTERS + INPUT_MOMENTS:
                getattr(self, buf.name).copy_(buf.initial(self, self.device))
            W = self._init_rows(0, self.num_classes, self.device)
        self._check_weight(W)
        self.W.copy_(W)
        self._uninitialised = False
        self._version += 1

    def _loss_of(self, O: Tensor, idx: Tensor, T: Tensor, draw=None):
        Y = torch.zeros_like(O).scatter_add_(1, idx.clamp(min=0), T)  # T is 0 on padding
        if draw is None:
            return self.reduce(self.loss_fn.dense(O, Y), idx)
        cols, _, _, slots = draw  # the sampled classes: the same draw as the factored head's
        A_neg = O[:, cols] if cols.dim() == 1 else O.gather(1, cols)
        return self.reduce(self.loss_fn.with_slots_dense(O, Y, T, A_neg, slots, idx=idx), idx)

    def _eval_loss(self, Hx, idx, T):
        return self._loss_of(Hx @ self.W.T, idx, T)

    def _forward_step(self, Hx, idx, T):
        with torch.enable_grad():
            Hl = Hx.detach().requires_grad_()
            Wl = self.W.detach().requires_grad_()  # W changes only after autograd.grad ran
            draw = None if self.negatives is None else self.negatives.draw(self, idx)
            O = Hl @ Wl.T
            L = self._loss_of(O, idx, T, draw)
        return L.detach(), (L, Hl, Wl, None if self.preconditioner is None else (idx >= 0).any(1))

    @torch.no_grad()
    def _hidden_grad(self, saved, grad_out):
        L, Hl = saved[:2]
        return torch.autograd.grad(L, Hl, grad_out, retain_graph=True)[0]

    @torch.no_grad()
    def _pending_record(self, saved, weight, m):  # m: the batch's rows (H's: none padded here)
        L, Hl, Wl, real = saved[:4]
        return torch.autograd.grad(L, Wl, weight, retain_graph=True)[0], Hl.detach(), real

    @torch.no_grad()
    def _apply_records(self, records: list) -> None:
        dW = sum(r[0] for r in records)
        real = None if records[0][2] is None else torch.cat([r[2] for r in records])
        self._apply_dW(torch.zeros(()), dW, torch.cat([r[1] for r in records]), real)

    @torch.no_grad()
    def _backward_step(self, saved, grad_out):
        L, Hl, Wl, real = saved
        dH, dW = torch.autograd.grad(L, (Hl, Wl), grad_out)
        return self._apply_dW(dH, dW, Hl.detach(), real)

    def _apply_dW(self, dH: Tensor, dW: Tensor, Hx: Tensor, real: Tensor | None) -> Tensor:
        """The SGD step with dL/dW (times P), unless something is non-finite; dL/dH (zeros when skipped)."""
        if not (torch.isfinite(dH).all() and torch.isfinite(dW).all() and torch.isfinite(Hx).all()):
            self._skip("hidden states or loss gradients")
            return torch.zeros_like(dH)
        moments = None
        if self.preconditioner is not None:
            moments = self.preconditioner.update_moments(self.input_moment, self.input_moment_weight, Hx, real)
            dW = dW @ moments.P
        if self.clip_norm is not None:  # the gradient scaled to a norm of at most clip_norm
            dW = dW * torch.clamp(self.clip_norm / torch.linalg.matrix_norm(dW), max=1.0)
        W_new = self.W - self.lr * (dW + self.weight_decay * self.W)
        if not (torch.isfinite(W_new).all() and (moments is None or moments.ok)):
            self._skip("weights after the step")
            return torch.zeros_like(dH)
        self.W.copy_(W_new)
        if moments is not None:
            moments.write(self, moments.ok)  # (checked above: True)
        self.steps += 1
        self._version += 1
        return dH

    @own_precision
    @torch.no_grad()
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        Hx, _, _ = self.prepare(hidden)
        return self.loss_fn.score(Hx @ self.W[start:class_range(self.num_classes, start, end)].T)

    @own_precision
    @torch.no_grad()
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        Hx, idx, _ = self.prepare(hidden, target_idx)
        logp = self.loss_fn.dense_log_prob(Hx @ self.W.T).gather(1, idx.clamp(min=0))
        logp = logp.masked_fill(idx < 0, 0.0)
        return logp[:, 0] if target_idx.dim() == 1 else logp

    def stats(self) -> dict[str, float]:
        return {"steps": int(self.steps), "skipped_nonfinite": int(self.skipped_nonfinite)}

