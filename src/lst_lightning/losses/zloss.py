"""The Z-loss of de Brebisson & Vincent (2016)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import SphericalLoss


class ZLoss(SphericalLoss):
    """``l = sum_k t_k softplus(a (b - z_k)) / a`` with ``z = (o - mu) / sigma``,
    ``mu = s / D`` and ``sigma = sqrt(q / D - mu^2 + eps)``.

    Defaults ``a = 0.03, b = 10``: the best MRR of the sweeps at D = 10^4, 10^5 and 10^6
    (docs/learning_at_scale.md; the paper's Figure 1 uses a = 0.1). Its study shows a
    (and b less so) decide which top-k error the model favours (b = 28 with a swept in
    its Penn Tree Bank study). ``eps`` keeps sigma positive for an all-constant output.
    The loss is invariant to the scale of the outputs, so it wants a large step
    (``default_lr`` 1.0).
    """

    default_lr = 1.0

    name = "zloss"

    def __init__(self, a: float = 0.03, b: float = 10.0, eps: float = 1e-8):
        super().__init__()
        if not a > 0:
            raise ValueError(f"zloss needs a > 0, got {a}")
        if not eps > 0:
            raise ValueError(f"zloss needs eps > 0, got {eps}")
        self.a, self.b, self.eps = float(a), float(b), float(eps)

    def hparams(self):
        return {"a": self.a, "b": self.b, "eps": self.eps}

    def _per_slot(self, A, mu, var):
        # q/D - mu^2 >= 0 exactly, but rounding can push it below 0.
        z = (A - mu) / torch.sqrt(var.clamp_min(0.0) + self.eps)
        return F.softplus(self.a * (self.b - z)) / self.a

    def forward(self, q, s, A, T, *, num_classes, y_sq=None):
        mu = (s / num_classes)[:, None]
        var = (q / num_classes)[:, None] - mu * mu
        return (T * self._per_slot(A, mu, var)).sum(1)

    def grads(self, q, s, A, T, weight, *, num_classes, y_sq=None):
        """In closed form (autograd's small ops cost more than the arithmetic). With
        u = a (b - z) and g_k = -w t_k sigmoid(u_k) = dL/dz_k: dL/dA = g / sigma,
        dL/dvar = -sum_k g_k z_k / (2 sigma^2) (0 where var was clamped),
        dL/dmu = -sum_k g_k / sigma - 2 mu dL/dvar; then dL/dq = dL/dvar / D, dL/ds = dL/dmu / D."""
        # forward's z, as _per_slot makes it, written out: u, z and sigma are all needed here
        D = num_classes
        mu = (s / D)[:, None]
        var = (q / D)[:, None] - mu * mu
        sigma = torch.sqrt(var.clamp_min(0.0) + self.eps)
        z = (A - mu) / sigma
        u = self.a * (self.b - z)
        per = (T * F.softplus(u) / self.a).sum(1)
        slope = torch.where(u > 20.0, torch.ones((), dtype=u.dtype, device=u.device), torch.sigmoid(u))  # softplus's
        g = -(T * slope) * weight[:, None]
        GA = g / sigma
        d_var = torch.where(var >= 0, -(g * z).sum(1, keepdim=True) / (2.0 * sigma * sigma), 0.0)
        d_mu = -GA.sum(1, keepdim=True) - 2.0 * mu * d_var
        return per, d_var[:, 0] / D, d_mu[:, 0] / D, GA

    def dense(self, O, Y):
        mu = O.mean(1, keepdim=True)
        var = O.var(1, unbiased=False, keepdim=True)
        return (Y * self._per_slot(O, mu, var)).sum(1)
