"""The spherical loss family: per-example losses that read the D-wide output
``o = W h`` only through ``q = ||o||^2``, ``s = sum(o)`` and the K target
outputs ``a = o[idx]`` (Vincent et al., 2015).

Each loss maps m-sized tensors to per-example losses; the factored head gets
``dL/dq``, ``dL/ds`` and ``dL/dA`` by autograd on those small tensors. Each
loss also has ``dense``, the same loss written on the full output and the
dense target vector ``y`` (``y[idx_k] += t_k``): the naive head uses it, so
the test of factored against naive also checks the (q, s, a) rewriting.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class SphericalLoss(nn.Module):
    """Base class. Subclasses set ``name`` and implement ``forward`` and ``dense``."""

    name: str = ""
    #: True when the loss defines normalised probabilities (perplexity).
    normalised: bool = False
    #: True when a training step needs sampled classes (the head's ``negatives``): the
    #: composite loss (sampled_composite.py)
    sampled: bool = False
    #: True when the outputs o are the logits of the model's distribution, softmax(o) (the
    #: composite loss with a sampled-softmax term): an exported model samples from them as they are
    outputs_are_logits: bool = False
    #: True when the loss reads ``y_sq`` (the squared error, or a composite holding it)
    needs_y_sq: bool = False
    #: The head's SGD lr when none is given (the one source: the app builds the head with head.lr
    #: null); a loss whose best lr depends on D says so in ``default_lr_for``.
    default_lr: float = 0.01

    @classmethod
    def default_lr_for(cls, num_classes: int) -> float:
        """The head's lr for D = ``num_classes`` classes when none is given."""
        return cls.default_lr

    def for_classes(self, num_classes: int) -> "SphericalLoss":
        """This loss for D = ``num_classes`` classes: itself, unless a setting left null follows a
        rule in D (the composite loss's mu)."""
        return self

    def forward(self, q: Tensor, s: Tensor, A: Tensor, T: Tensor, *, num_classes: int,
                y_sq: Tensor | None = None) -> Tensor:
        """Per-example losses (m,).

        q, s: (m,); A: (m, K) target outputs; T: (m, K) target values, zero on
        padding slots (whose A is 0). y_sq: (m,) the squared norm of the dense
        target vector, needed by the squared error only.
        """
        raise NotImplementedError

    def dense(self, O: Tensor, Y: Tensor) -> Tensor:
        """The same per-example losses from the full output O (m, D) and dense targets Y (m, D)."""
        raise NotImplementedError

    def grads(self, q: Tensor, s: Tensor, A: Tensor, T: Tensor, weight: Tensor, *, num_classes: int,
              y_sq: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The per-example losses (m,) and the gradients of ``sum_i weight_i l_i`` (a row of
        weight 0 adds nothing, whatever its loss) with respect to q, s and A: by autograd on
        these m-sized tensors, by ``torch.func.vjp``, which ``torch.compile`` traces (a compiled
        step takes every loss). A loss may give them in closed form instead (tests/losses hold
        each to this)."""
        def losses(q, s, A):  # (the losses of rows of weight 0 masked: no gradient, NaN or not; all of them)
            per = self(q, s, A, T, num_classes=num_classes, y_sq=y_sq)
            return torch.where(weight != 0, per, torch.zeros((), dtype=per.dtype, device=per.device)), per

        with torch.enable_grad():
            _, pullback, per = torch.func.vjp(losses, q.detach(), s.detach(), A.detach(), has_aux=True)
            gq, gs, GA = pullback(weight.to(per.dtype))
        return per.detach(), gq, gs, GA

    def score(self, O: Tensor) -> Tensor:
        """The model's own score of each class from its outputs O (any shape): higher is more
        likely under this loss. Ranking (top-k, target ranks, every metric) uses it; the plain
        output ``o`` unless the loss's probability is not increasing in o."""
        return O

    def init_std(self, num_classes: int, width: int) -> float:
        """The std of the initial W's entries (``width`` columns, the bias column included)
        that this loss learns from at ``num_classes`` = D: ``min(1/sqrt(width), 1/sqrt(D))``
        for the Z-loss and the squared error, so that the initial outputs' squared norm stays
        about ``||h||^2`` at every D. A random part that grows with D would make the Z-loss's
        spread sigma (removed only at 1/D per row) and dominate the squared error's
        ``||o||^2`` at large D (docs/learning_at_scale.md)."""
        return max(width, num_classes) ** -0.5

    def log_prob(self, q: Tensor, s: Tensor, A: Tensor, *, num_classes: int) -> Tensor:
        """log p of each target slot (m, K), for normalised losses."""
        raise NotImplementedError(f"the {self.name} loss defines no probabilities")

    def dense_log_prob(self, O: Tensor) -> Tensor:
        """log p of every class (m, D), for normalised losses: the reference of ``log_prob``."""
        raise NotImplementedError(f"the {self.name} loss defines no probabilities")

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hparams().items())

    def hparams(self) -> dict:
        return {}


class NormalisedSphericalLoss(SphericalLoss):
    """A loss ``-sum_k t_k log p[idx_k]`` for a normalised spherical distribution p."""

    normalised = True

    def init_std(self, num_classes: int, width: int) -> float:
        # 1/sqrt(width) at every D: the normaliser has a floor per class (D eps for the
        # spherical softmax, D for Taylor), to which the random part adds a share that does
        # not grow with D; and these losses' gradients vanish with the outputs (the spherical
        # softmax's 2 o / (o^2 + eps)) or hand the body only as much as W holds, so a W
        # started at 1/sqrt(D) left both at the class frequencies at D = 10^6 (measured:
        # docs/learning_at_scale.md).
        return width ** -0.5

    def forward(self, q, s, A, T, *, num_classes, y_sq=None):
        return -(T * self.log_prob(q, s, A, num_classes=num_classes)).sum(1)

    def dense(self, O, Y):
        return -(Y * self.dense_log_prob(O)).sum(1)
