"""Taylor softmax: ``p_i = (1 + o_i + o_i^2/2) / (D + s + q/2)``."""
from __future__ import annotations

import torch

from .base import NormalisedSphericalLoss


class TaylorSoftmaxLoss(NormalisedSphericalLoss):
    """Negative log-likelihood of the second-order Taylor softmax.

    No hyperparameters: ``1 + x + x^2/2 >= 1/2`` so every probability is positive.
    """

    name = "taylor_softmax"

    def score(self, O):
        # p's numerator: not monotone in o (it falls for o < -1).
        return 1.0 + O + 0.5 * O * O

    def log_prob(self, q, s, A, *, num_classes):
        return torch.log(1.0 + A + 0.5 * A * A) - torch.log(num_classes + s + 0.5 * q)[:, None]

    def dense_log_prob(self, O):
        num = 1.0 + O + 0.5 * O * O
        return torch.log(num / num.sum(1, keepdim=True))
