"""Linearisable kernels (kernel_functions.py): random Fourier features estimate the Gaussian kernel without bias."""
from __future__ import annotations

import math

import torch

from lst_lightning.heads.kernel_functions import RandomFourierKernel


def test_rff_kernel_is_unbiased_gaussian():
    """phi(x).phi(y) averages to exp(-nu ||x - y||^2 / 2) on unit vectors (over seeds)."""
    x, y = torch.nn.functional.normalize(torch.randn(2, 5), dim=1)
    nu = 3.0
    vals = torch.stack([
        (RandomFourierKernel(5, 256, nu, seed=s).query(x[None]) * RandomFourierKernel(5, 256, nu, seed=s)
         .query(y[None])).sum() for s in range(200)])
    target = math.exp(-nu * float(((x - y) ** 2).sum()) / 2)
    assert abs(vals.mean().item() - target) < 4 * vals.std().item() / math.sqrt(200) + 1e-4
