"""The composite loss of sampled classes inside the exact step:

    l = CE over [the row's targets, its S sampled negatives]      (sampled softmax)
      + mu * a spherical loss of the target slots                  (the Z-loss by default)
      + gram * q                                                   (lambda ||o||^2 = lambda h^T Q h)

The sampled-softmax term is the one of ``SampledSoftmaxHead`` (baselines/sampled.py): the
negatives' outputs carry the correction ``-log(k q / (1 - q_T))`` (k kept negatives, q_T
the proposal's mass on the row's targets) and accidental hits (a negative equal to one
of the row's targets) are masked out; with K > 1 targets the CE is ``sum_k t_k (logZ -
a_k)``, each target class counted once in Z. The spherical terms act on all D classes at
once (they read q and s), which no sampled method affords.

The head computes the slots (the draw, the correction and the hit mask: the exact head's
``negatives``, spherical/negatives.py) and hands them over as ``SampledSlots``. Two forms,
as every loss of the zoo: ``with_slots`` on (q, s, A, A_neg) for the factored head and
``with_slots_dense`` on the explicit outputs O for the naive head. Without slots (evaluation,
no draw) ``forward`` is the spherical terms alone.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lst_kernels.torch_ops import logsumexp_rows  # torch on every device: no kernel to choose, inputs made here

from .base import SphericalLoss
from .mse import MSELoss
from .spherical_softmax import SphericalSoftmaxLoss
from .taylor_softmax import TaylorSoftmaxLoss
from .zloss import ZLoss

_SPHERICAL = {cls.name: cls for cls in (MSELoss, SphericalSoftmaxLoss, TaylorSoftmaxLoss, ZLoss)}


class SampledSlots(NamedTuple):
    """What the head's draw hands the loss: per row and negative (m, S), the correction of
    its output and the accidental-hit mask; per target slot (m, K), whether it is its
    class's first occurrence in the row (padding: False)."""
    correction: Tensor
    hit: Tensor
    first: Tensor


class SampledCompositeLoss(SphericalLoss):
    """Sampled-softmax CE + ``mu`` times a spherical loss (``spherical``, with
    ``spherical_kwargs``) of the target slots + ``gram`` times q. Needs a head with
    ``negatives`` (the head refuses the one without the other)."""

    name = "sampled"
    #: the head needs sampled slots to compute this loss in a training step
    sampled = True
    #: the softmax term makes the outputs logits: the model's distribution is softmax(o)
    outputs_are_logits = True
    #: the head's lr and mu (``mu`` null) by D; S follows its own rule in D, shared with the
    #: sampled softmax up to 10^6 classes (``heads.samplers.default_num_samples``: 64 below 10^5
    #: classes, 512 from there; the sampled softmax takes 1024 from 10^6, the slots from 10^7:
    #: ``heads.samplers.slots_num_samples``). Below ``large_D`` classes ``small_D_*``: the best on
    #: the embedded corpus at its own D (33 155; benchmarks/results/quality_own_D_sampled_lr_*.csv).
    #: From ``large_D``: ``large_D_*``, the best for the same training time with the lr decaying over
    #: it (docs/sampled_slots_tuning.md; docs/results/equal_time.md: mu 0.1 ahead of 0.3, lr 16
    #: and S 512 ahead of lr 8 and S 64)
    small_D_lr, small_D_mu = 2.0, 1.0
    large_D = 100_000
    large_D_lr, large_D_mu = 16.0, 0.1

    @classmethod
    def default_lr_for(cls, num_classes: int) -> float:
        return cls.large_D_lr if num_classes >= cls.large_D else cls.small_D_lr

    @classmethod
    def default_mu_for(cls, num_classes: int) -> float:
        """mu for D = ``num_classes`` classes when ``mu`` is null."""
        return cls.large_D_mu if num_classes >= cls.large_D else cls.small_D_mu

    def for_classes(self, num_classes: int) -> "SampledCompositeLoss":
        """This loss with ``mu`` for D = ``num_classes`` classes: itself when mu is set, else a
        copy with the rule in D's (the head calls this once, at construction)."""
        if self.mu_setting is not None:
            return self
        return type(self)(mu=self.default_mu_for(num_classes), spherical=self.spherical_name,
                          spherical_kwargs=self.spherical_kwargs, gram=self.gram)

    def __init__(self, mu: float | None = None, spherical: str = "zloss", spherical_kwargs: dict | None = None,
                 gram: float = 0.0):
        super().__init__()
        if spherical not in _SPHERICAL:
            raise ValueError(f"spherical must be one of {sorted(_SPHERICAL)}, got {spherical!r}")
        for name, v in (("mu", 0.0 if mu is None else mu), ("gram", gram)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and v < float("inf")):
                rule = " or None (the rule in D)" if name == "mu" else ""
                raise ValueError(f"{name} must be a finite number >= 0{rule}, got {v!r}")
        #: mu as given (None: the rule in D, ``for_classes``); ``mu`` the one in use (alone,
        #: without a head's D: the small-D value)
        self.mu_setting = None if mu is None else float(mu)
        self.mu, self.gram = self.small_D_mu if mu is None else float(mu), float(gram)
        self.spherical_name, self.spherical_kwargs = spherical, dict(spherical_kwargs or {})
        self.spherical = _SPHERICAL[spherical](**self.spherical_kwargs)
        self.needs_y_sq = self.spherical.needs_y_sq
        #: ``with_slots_grads``' terms past the CE, chosen once by which of gram and mu are on
        self.terms = {(False, False): self._no_terms, (True, False): self._gram_term,
                      (False, True): self._spherical_term,
                      (True, True): self._gram_and_spherical_terms}[bool(self.gram), bool(self.mu)]

    def hparams(self):
        return {"mu": self.mu, "spherical": self.spherical_name, "spherical_kwargs": self.spherical_kwargs,
                "gram": self.gram}

    def init_std(self, num_classes: int, width: int) -> float:
        return self.spherical.init_std(num_classes, width)

    # -- the spherical terms (all D classes) ---------------------------------------------
    def forward(self, q, s, A, T, *, num_classes, y_sq=None):
        """The spherical terms alone (no sampled slots: evaluation)."""
        per = q * self.gram
        if self.mu:
            per = per + self.mu * self.spherical(q, s, A, T, num_classes=num_classes, y_sq=y_sq)
        return per

    def dense(self, O, Y):
        per = self.gram * (O * O).sum(1)
        if self.mu:
            per = per + self.mu * self.spherical.dense(O, Y)
        return per

    # -- with the sampled slots ----------------------------------------------------------
    @staticmethod
    def sampled_ce(A: Tensor, T: Tensor, A_neg: Tensor, slots: SampledSlots) -> Tensor:
        """Per-row sampled-softmax CE: ``sum_k t_k (logsumexp(Z) - a_k)``, Z the targets (each
        class once, padding out) and the corrected negatives that are no accidental hit."""
        neg_inf = torch.full((), float("-inf"), dtype=A.dtype, device=A.device)  # no host copy: graphs
        o_t = torch.where(slots.first, A, neg_inf)
        o_n = torch.where(slots.hit, neg_inf, A_neg - slots.correction.to(A.dtype))
        log_z = logsumexp_rows(torch.cat([o_t, o_n], 1))
        return (T * (log_z - A)).sum(1)  # T is 0 on padding

    def with_slots(self, q, s, A, T, A_neg, slots: SampledSlots, *, num_classes, y_sq=None):
        """Per-row losses from q, s, the target outputs A (m, K) and the negatives' A_neg (m, S)."""
        return self.sampled_ce(A, T, A_neg, slots) + self.forward(q, s, A, T, num_classes=num_classes, y_sq=y_sq)

    def with_slots_grads(self, q, s, A, T, A_neg, slots: SampledSlots, weight, *, num_classes, y_sq=None):
        """``with_slots``'s per-row losses and the gradients of ``sum_i weight_i l_i`` with respect
        to q, s, A and A_neg, the factored head's step: the CE's in closed form (w = weight_i
        sum_k t_k; p the softmax over the slots: dL/dA_neg = w p on the negatives, dL/dA_k =
        w p_k on a class's first slot - weight_i t_k), the spherical term's by its ``grads``.
        Held to autograd of ``with_slots`` by tests/losses."""
        zero = torch.zeros((), dtype=A.dtype, device=A.device)
        neg_inf = torch.full((), float("-inf"), dtype=A.dtype, device=A.device)  # no host copy: graphs
        K = A.shape[1]
        Zc = torch.cat([torch.where(slots.first, A, neg_inf),  # sampled_ce's logits
                        torch.where(slots.hit, neg_inf, A_neg - slots.correction.to(A.dtype))], 1)
        log_z, p = logsumexp_rows(Zc, with_softmax=True)
        per = (T * (log_z - A)).sum(1)
        wT = T * weight[:, None]
        G = wT.sum(1, keepdim=True) * p
        GA = torch.where(slots.first, G[:, :K], zero) - wT
        gq = self.gram * weight
        gs = torch.zeros_like(s)
        per, gq, gs, GA = self.terms(per, gq, gs, GA, q, s, A, T, weight, num_classes, y_sq)
        return per, gq, gs, GA, G[:, K:]

    # -- ``terms``: the spherical terms' parts of ``with_slots_grads``, one per setting of gram and mu --
    def _no_terms(self, per, gq, gs, GA, q, s, A, T, weight, num_classes, y_sq):
        """gram and mu 0: the CE alone."""
        return per, gq, gs, GA

    def _gram_term(self, per, gq, gs, GA, q, s, A, T, weight, num_classes, y_sq):
        """``gram q`` (its gradient ``gram weight`` is g_q's start)."""
        return per + self.gram * q, gq, gs, GA

    def _spherical_term(self, per, gq, gs, GA, q, s, A, T, weight, num_classes, y_sq):
        """``mu`` times the spherical loss, with its gradients (its ``grads``)."""
        sph, sq, ss, sA = self.spherical.grads(q, s, A, T, self.mu * weight, num_classes=num_classes, y_sq=y_sq)
        return per + self.mu * sph, gq + sq, gs + ss, GA + sA

    def _gram_and_spherical_terms(self, per, gq, gs, GA, *rest):
        """Both, gram's first."""
        return self._spherical_term(*self._gram_term(per, gq, gs, GA, *rest), *rest)

    def with_slots_dense(self, O, Y, T, A_neg, slots: SampledSlots, *, idx):
        """The same per-row losses from the explicit outputs O (m, D): the reference."""
        A = torch.where(idx >= 0, O.gather(1, idx.clamp(min=0)), torch.zeros((), dtype=O.dtype, device=O.device))
        return self.sampled_ce(A, T, A_neg, slots) + self.dense(O, Y)
