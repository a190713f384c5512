"""The right preconditioner of the output layer's update: W <- c W - lr dO^T H P.

The exact step needs the update of W to be ``dO^T`` times something of m rows; any d x d
matrix P on the right keeps it so. With P the inverse of the damped second moment of the
head's inputs (the input factor of K-FAC, or Shampoo's right factor with power -1) the
step is preconditioned along the hidden directions, for every class at once, and stays
exact and O(m d^2 + d^3): the factored head takes ``X = H P`` where the plain step takes
H on the update's side (``U B``, omega, wbar, Q's bookkeeping, the rows scattered into V),
and the naive head steps with ``dW P`` (spherical/naive.py). dL/dH is unchanged. The sampled
softmax takes the same P on its drawn rows' gradient (``SampledSoftmaxHead(preconditioner=)``,
baselines/preconditioned_rows.py), for the rows' SGD step.

    S_t = beta S_{t-1} + (1 - beta) H^T H / m,    w_t = beta w_{t-1} + (1 - beta)
    (over the m rows with a target; a batch with none leaves S and w as they were)
    tau = tr(S_t / w_t) / d
    P   = tau (1 + damping) (S_t / w_t + damping tau I)^-1

``w_t`` corrects the running mean for its start at zero; the factor ``tau (1 + damping)``
makes P = I wherever the inputs are white (S = tau I), so the head's lr keeps its meaning.
P's eigenvalues lie in (0, (1 + damping) / damping]. The moments are two buffers of the
head (``input_moment``, ``input_moment_weight``; of the exact head's state, spherical/state.py),
written with the step: a skipped step leaves them untouched, a checkpoint resumes them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .settings import settings_from


@dataclass(frozen=True)
class Preconditioner:
    """``beta``: the running mean's decay, in [0, 1) (0: this batch's moment alone);
    ``damping``: added to S as a fraction of its mean eigenvalue, > 0."""

    beta: float = 0.99
    damping: float = 0.1

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not (number(self.beta) and 0.0 <= self.beta < 1.0):
            raise ValueError(f"preconditioner.beta must be a number in [0, 1), got {self.beta!r}")
        if not (number(self.damping) and math.isfinite(self.damping) and self.damping > 0):
            raise ValueError(f"preconditioner.damping must be a number finite and > 0, got {self.damping!r}")

    @classmethod
    def of(cls, value) -> "Preconditioner | None":
        """The settings from a Preconditioner, a dict of some of its fields (a Hydra config), or None (off)."""
        return None if value is None else settings_from(cls, value, "preconditioner")

    @property
    def max_eig(self) -> float:
        """A bound on P's largest eigenvalue, (1 + damping) / damping (S's are >= 0)."""
        return (1.0 + self.damping) / self.damping

    def update_moments(self, moment: Tensor, weight: Tensor, Hx: Tensor, real: Tensor | None = None,
                       summed: Callable | None = None) -> "Moments":
        """``moments_of`` of the rows of ``Hx`` with a target (``real``; None: every row). ``summed``:
        where a step's rows are several processes' (the sampled softmax's), a function that sums
        this batch's X^T X and row count over them (None: this batch's own). (The exact step forms
        them inline, its path one function shorter.)"""
        real = torch.ones(Hx.shape[0], dtype=torch.bool, device=Hx.device) if real is None else real
        Hr = torch.where(real[:, None], Hx, 0.0)
        gram, n = Hr.T @ Hr, real.sum()
        if summed is not None:
            gram, n = summed(gram, n)
        return self.moments_of(moment, weight, gram, n)

    def moments_of(self, moment: Tensor, weight: Tensor, gram: Tensor, n: Tensor) -> "Moments":
        """This step's moments (computed aside: the head's buffers are not touched) and P, from the
        batch's ``gram``, X^T X over its rows with a target, and ``n``, their count (a batch without
        any leaves the moments as they were; several processes' rows: each summed over the ranks,
        the sampled softmax's). No host read: a failed Cholesky factorisation is the flag ``ok``."""
        w = gram.shape[0]
        beta = torch.full((), self.beta, dtype=gram.dtype, device=gram.device)  # in the moments' precision
        keep = torch.where(n > 0, beta, torch.ones_like(beta))  # the old moment's share
        S = moment * keep + gram * ((1.0 - keep) / n.clamp(min=1))
        t = weight * keep + (1.0 - keep)
        mean = S / t.clamp_min(torch.finfo(gram.dtype).tiny)  # t = 0: no row with a target yet, S = 0
        # H = 0 throughout (or no row with a target yet): P = I (1 + damping) / damping; the floor keeps
        # damping * tau a normal number (a subnormal one fails the factorisation in float32)
        tau = mean.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny / min(self.damping, 1.0))
        eye = torch.eye(w, dtype=gram.dtype, device=gram.device)
        C, info = torch.linalg.cholesky_ex(mean + (self.damping * tau) * eye)
        Cinv = torch.linalg.solve_triangular(C, eye, upper=False)
        L = (tau * (1.0 + self.damping)).sqrt() * Cinv.T  # P = L L^T = tau (1 + damping) C^-T C^-1
        return Moments(S, t, L @ L.T, info == 0)


@dataclass
class Moments:
    """One step's new running moment and its weight, P, and whether the factorisation held."""
    moment: Tensor
    weight: Tensor
    P: Tensor
    ok: Tensor

    def write(self, state, ok: Tensor) -> None:
        """Into the buffers ``input_moment`` and ``input_moment_weight`` of ``state`` (a head, or the
        step's ``StepState``), with its step where ``ok``, a device flag."""
        for buf, new in ((state.input_moment, self.moment), (state.input_moment_weight, self.weight)):
            buf[...] = torch.where(ok, new, buf)  # through a view: exact_step.py's ``update`` says why
