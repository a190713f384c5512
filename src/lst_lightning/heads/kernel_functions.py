"""Linearisable kernels K(h, c) = phi(h) . phi(c) for kernel-based sampling.

Each kernel gives the query features of hidden rows, what the sum-tree keeps
per class (``leaf_state``), the kernel values of a row against such states,
and the summed features of a block of classes (what a tree node stores). They compute
in float32, or in float64 when given float64 (the exact head's float64 state).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: the quadratic kernel's alpha by default (the baseline's sampler; the spherical heads' negatives record it)
QUADRATIC_ALPHA = 100.0


def working(x: Tensor) -> Tensor:
    """x in the kernels' working dtype: float64 stays float64, anything else float32."""
    return x if x.dtype == torch.float64 else x.float()


class Kernel(nn.Module):
    feature_dim: int

    def query(self, hidden: Tensor) -> Tensor:
        """phi(h): (..., F)."""
        raise NotImplementedError

    def leaf_state(self, emb: Tensor) -> Tensor:
        """What the tree stores per class, (n, *)."""
        raise NotImplementedError

    def leaf_values(self, q: Tensor, hidden: Tensor, state: Tensor) -> Tensor:
        """K(h, c) for query rows (W, F) / hidden (W, d) against states (W, B, *) or (B, *): (W, B)."""
        raise NotImplementedError

    def block_sums(self, state: Tensor, mask: Tensor) -> Tensor:
        """Sum of phi(c) over each block: states (nb, B, *), mask (nb, B) -> (nb, F)."""
        raise NotImplementedError


class RandomFourierKernel(Kernel):
    """RF-softmax (Rawat et al. 2019): on unit vectors, exp(tau h.c) = e^tau exp(-tau ||h - c||^2 / 2),
    a Gaussian kernel, approximated by random Fourier features:
    phi(u) = [cos(u w_i), sin(u w_i)]_i / sqrt(D_rff) with w_i ~ N(0, nu I), so that
    E[phi(x) . phi(y)] = exp(-nu ||x - y||^2 / 2). nu = tau reproduces the softmax in
    expectation; a smaller nu trades bias for variance (the paper's advice).
    """

    def __init__(self, hidden_dim: int, num_features: int = 256, nu: float = 1.0, seed: int | None = 0):
        super().__init__()
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features (D_rff) must be a positive int, got {num_features!r}")
        if not (nu > 0 and math.isfinite(nu)):
            raise ValueError(f"nu must be a finite number > 0, got {nu}")
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        self.nu, self.num_features = float(nu), num_features
        self.feature_dim = 2 * num_features
        self.register_buffer("omega", torch.randn(hidden_dim, num_features, generator=g) * math.sqrt(nu))

    def query(self, hidden):
        hidden = working(hidden)
        z = F.normalize(hidden, dim=-1) @ self.omega.to(hidden.dtype)
        return torch.cat([z.cos(), z.sin()], -1) / math.sqrt(self.num_features)

    def leaf_state(self, emb):
        return self.query(emb)

    def leaf_values(self, q, hidden, state):
        return torch.matmul(state, q.to(state.dtype).unsqueeze(-1)).squeeze(-1)

    def block_sums(self, state, mask):
        return (state * mask.unsqueeze(-1)).sum(1)


class QuadraticKernel(Kernel):
    """Blanc & Rendle (2018): K(h, c) = alpha (h.c)^2 + 1, phi(z) = [sqrt(alpha) vec(z z^T), 1]:
    F = d^2 + 1, so a tree node stores sum c c^T and a count; a leaf costs only O(d)."""

    def __init__(self, hidden_dim: int, alpha: float = QUADRATIC_ALPHA):
        super().__init__()
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
        self.alpha = float(alpha)
        self.feature_dim = hidden_dim * hidden_dim + 1

    def query(self, hidden):
        h = working(hidden)
        outer = self.alpha * (h.unsqueeze(-1) * h.unsqueeze(-2)).flatten(-2)
        return torch.cat([outer, torch.ones_like(outer[..., :1])], -1)

    def leaf_state(self, emb):
        return working(emb)

    def leaf_values(self, q, hidden, state):
        dot = torch.matmul(state, hidden.to(state.dtype).unsqueeze(-1)).squeeze(-1)
        return self.alpha * dot * dot + 1.0

    def block_sums(self, state, mask):
        x = state * mask.unsqueeze(-1)
        outer = torch.einsum("nbd,nbe->nde", x, x).flatten(1)
        return torch.cat([outer, mask.sum(1, keepdim=True).to(outer.dtype)], 1)
