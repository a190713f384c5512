"""The loss of a head step that has already been applied (``head.train_step``, or its
replay from a CUDA graph), connected to the body: ``loss.backward()`` hands the step's
dL/dH on to H, scaled by the incoming gradient. Plain autograd: works in any loop."""
from __future__ import annotations

import torch
from torch import Tensor


class AppliedStep(torch.autograd.Function):
    """``AppliedStep.apply(H, loss, dH)``: ``loss`` in forward, ``dH * grad`` to H in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, loss: Tensor, dH: Tensor) -> Tensor:
        ctx.save_for_backward(dH)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (dH,) = ctx.saved_tensors
        return dH * grad, None, None
