"""The sampled softmax's drawn rows stepped with the exact head's right preconditioner
(``SampledSoftmaxHead(preconditioner=)``): where autograd gives the gathered rows of W (and b)
the gradient ``g^T X``, with ``X = [h, 1]`` (``X = h`` without a bias), they get ``g^T X P``,
P from the running moments of X (heads/preconditioner.py). An SGD step on the rows is then
``W <- W - lr dL/dO^T X P`` on the rows the step drew: the exact head's update with the all-class
term left out. The logits and dL/dh are those of plain autograd.

    o = (w . h) + b,   dL/dh = g w   (as autograd),   dL/dw = g (X P)[:d],   dL/db = g (X P)[d]

Repeats (a class drawn twice, or a target and a draw) sum in the gather's backward, as
autograd's do: the sum of ``g X P`` over them is their ``g X`` summed, times P.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class PreconditionedLogits(torch.autograd.Function):
    """The logits of gathered rows: ``w`` (S, d) shared by every row, giving (m, S), or (m, K, d) per
    row, giving (m, K); ``b`` their biases ((S,) or (m, K)) or None; ``XP`` (m, d + 1) with a bias,
    (m, d) without."""

    @staticmethod
    def forward(ctx, query: Tensor, w: Tensor, b: Tensor | None, XP: Tensor) -> Tensor:
        ctx.save_for_backward(w, XP)
        ctx.shared, ctx.bias = w.dim() == 2, b is not None
        return row_logits(query, w, b)

    @staticmethod
    def backward(ctx, g: Tensor):
        w, XP = ctx.saved_tensors
        d = w.shape[-1]
        w = w.to(g.dtype)  # under autocast the logits were a product in g's dtype: so are their gradients
        Xw = XP[:, :d].to(g.dtype)
        Xb = XP[:, d].to(g.dtype) if ctx.bias else None
        if ctx.shared:
            return g @ w, g.T @ Xw, None if Xb is None else g.T @ Xb, None
        return (torch.einsum("mk,mkd->md", g, w), g[:, :, None] * Xw[:, None, :],
                None if Xb is None else g * Xb[:, None], None)


def row_logits(query: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``w . query + b`` for gathered rows: ``w`` (S, d) shared by every row, giving (m, S), or
    (m, K, d) per row, giving (m, K)."""
    if w.dim() == 2:
        return F.linear(query, w, b)
    o = torch.einsum("mkd,md->mk", w, query)
    return o if b is None else o + b


def preconditioned_logits(query: Tensor, w: Tensor, b: Tensor | None, XP: Tensor) -> Tensor:
    """``PreconditionedLogits`` (autograd records it only while it records)."""
    return PreconditionedLogits.apply(query, w, b, XP)
