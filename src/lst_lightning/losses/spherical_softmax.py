"""Spherical softmax: ``p_i = (o_i^2 + eps) / (q + D eps)``."""
from __future__ import annotations

import torch

from .base import NormalisedSphericalLoss


class SphericalSoftmaxLoss(NormalisedSphericalLoss):
    """Negative log-likelihood of the spherical softmax.

    ``eps`` (default 0.01) keeps every probability positive when an output is
    exactly 0 (a fresh zero-initialised head) and bounds the gradient
    ``2 a / (a^2 + eps)``; de Brebisson & Vincent (2016) use a small constant
    of this order.
    """

    name = "spherical_softmax"

    def __init__(self, eps: float = 0.01):
        super().__init__()
        if not eps > 0:
            raise ValueError(f"spherical_softmax needs eps > 0, got {eps}")
        self.eps = float(eps)

    def hparams(self):
        return {"eps": self.eps}

    def score(self, O):
        # p grows with o^2: a large negative output is as likely as a large positive one.
        return O * O + self.eps

    def log_prob(self, q, s, A, *, num_classes):
        return torch.log(A * A + self.eps) - torch.log(q + num_classes * self.eps)[:, None]

    def dense_log_prob(self, O):
        num = O * O + self.eps
        return torch.log(num / num.sum(1, keepdim=True))
