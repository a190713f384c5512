"""Proposals that ignore the hidden row: uniform, log-uniform (Zipf over
frequency-sorted ids) and unigram^power. Each is a table of D probabilities,
sampled by inverse CDF (one searchsorted, no per-draw Python)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..class_counts import check_class_counts
from .base import Sampler, check_num_samples


class StaticSampler(Sampler):
    """q given by a fixed table of probabilities (float64, normalised)."""

    def __init__(self, probs: Tensor):
        super().__init__()
        probs = probs.to(torch.float64)
        if probs.dim() != 1 or probs.numel() < 1 or not torch.isfinite(probs).all() or (probs < 0).any():
            raise ValueError("a static proposal needs a 1-D table of finite non-negative weights")
        if not probs.sum() > 0:
            raise ValueError("a static proposal needs a positive total weight")
        probs = probs / probs.sum()
        self.num_classes = probs.numel()
        self.register_buffer("log_q", probs.log())
        self.register_buffer("cdf", torch.cumsum(probs, 0))

    def sample(self, num_samples, hidden=None, generator=None):
        n = check_num_samples(num_samples)
        u = torch.rand(n, dtype=torch.float64, device=self.cdf.device, generator=generator) * self.cdf[-1]
        idx = torch.searchsorted(self.cdf, u, right=True).clamp_(max=self.num_classes - 1)
        return idx, self.log_q[idx].float()

    def log_prob(self, classes, hidden=None):
        return self.log_q[classes.clamp(min=0)].float()


class UniformSampler(StaticSampler):
    def __init__(self, *, num_classes: int):
        super().__init__(torch.ones(num_classes))


class LogUniformSampler(StaticSampler):
    """Zipf law over ids sorted by decreasing frequency: q(k) = log((k+2)/(k+1)) / log(D+1)."""

    def __init__(self, *, num_classes: int):
        k = torch.arange(num_classes, dtype=torch.float64)
        super().__init__(torch.log1p(1.0 / (k + 1)) / math.log(num_classes + 1))


class UnigramSampler(StaticSampler):
    """q proportional to count^power (0.75 as in word2vec); classes never seen get ``smoothing``."""

    def __init__(self, *, num_classes: int, class_counts: Tensor, power: float = 0.75, smoothing: float = 0.0):
        if class_counts is None:
            raise ValueError("the unigram sampler needs class_counts")
        if not 0.0 <= power or not math.isfinite(power):
            raise ValueError(f"power must be a finite number >= 0, got {power}")
        if not smoothing >= 0.0:
            raise ValueError(f"smoothing must be >= 0, got {smoothing}")
        counts = check_class_counts(class_counts, num_classes)
        super().__init__((counts + smoothing) ** power)
        self.power = float(power)
