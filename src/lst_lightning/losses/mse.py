"""Squared error ``||o - y||^2``: the plain spherical loss of the NIPS paper."""
from __future__ import annotations

from .base import SphericalLoss


class MSELoss(SphericalLoss):
    """``||o - y||^2 = q - 2 sum_k t_k a_k + ||y||^2``; no hyperparameters."""

    name = "mse"
    needs_y_sq = True

    def forward(self, q, s, A, T, *, num_classes, y_sq=None):
        if y_sq is None:
            raise ValueError("the squared error needs y_sq, the squared norm of the target vector")
        return q - 2.0 * (T * A).sum(1) + y_sq

    def dense(self, O, Y):
        return ((O - Y) ** 2).sum(1)
