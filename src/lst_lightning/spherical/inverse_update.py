"""U_new^-1 from U^-1 by matrix products alone: the GPU's route to ``H U_new^-1``
(docs/algorithm.md, "The update").

The step makes ``U_new = U B`` with ``B = c (I - A)``, ``A = H^T diag(kappa) H`` symmetric
(d x d). So ``U_new^-1 = (1/c) (I - A)^-1 U^-1``, and where the spectral radius rho of A is
below 1, ``(I - A)^-1`` is the product of k Neumann factors ``(I + A)(I + A^2)(I + A^4)...``,
exact but for ``A^(2^k)``; Newton-Schulz steps against ``U_new`` itself then square the error
left (``Y <- Y + Y (I - U_new Y)``), and with it any drift of the U^-1 carried from the step
before. Every operation is a d x d GEMM: no factorisation, no pivoting, no host read, and
the whole of it fits in a CUDA graph. On a GPU that replaces the LU of U_new a step
(cuSOLVER's 512 x 512 ``getrf``, latency-bound: 0.79 ms of the 1.8 ms of an H200's step at
d = 512, m = 1024, benchmarks/results/profile_step_NVIDIA-H200.txt) by about 2 k + 5 GEMMs.
On a CPU the LU is the cheaper (a d^3 / 3 factorisation against 2 k + 5 products of d^3).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

#: the most Neumann factors a step takes (rho up to about 0.9 at cond(U) 4)
MAX_FACTORS = 6
#: Newton-Schulz steps after the product: the residual before them, raised to 2^2, is what is left
NEWTON_STEPS = 2


def residual_tolerance(dtype: torch.dtype) -> float:
    """The largest residual ``||I - U_new Y||`` before the Newton-Schulz steps whose 4th power
    (what the two steps leave) is the dtype's rounding: eps^(1/4)."""
    return torch.finfo(dtype).eps ** (1.0 / 2 ** NEWTON_STEPS)


def neumann_factors(rho: float, cond_bound: float, dtype: torch.dtype) -> int | None:
    """The fewest factors k with ``cond(U) rho^(2^k)`` (a bound on the residual before the
    Newton-Schulz steps) within ``residual_tolerance``; None when more than MAX_FACTORS
    would be needed (rho near 1, or not finite: ``adaptive_factors`` then takes MAX_FACTORS)."""
    if not (math.isfinite(rho) and math.isfinite(cond_bound)) or rho >= 1.0:
        return None
    tol = residual_tolerance(dtype) / max(cond_bound, 1.0)
    if rho <= 0.0:
        return 1
    k = max(1, math.ceil(math.log2(math.log(tol) / math.log(rho))))
    return k if k <= MAX_FACTORS else None


#: ``Stabiliser.neumann="adaptive"``: the next steps' factors are those for this many times
#: the largest rho bound of the steps before, at twice the larger of cond(U)'s bound and the
#: repairs' trigger, and never fewer than ADAPTIVE_MIN_FACTORS
ADAPTIVE_MARGIN = 4.0
ADAPTIVE_MIN_FACTORS = 2


def adaptive_factors(rho_max: float, cond_bound: float, cond_trigger: float, skipped: bool,
                     dtype: torch.dtype) -> int:
    """The Neumann factors of the next steps under device flags (``neumann="adaptive"``), from
    the largest rho bound ``rho_max`` since the last read of the flags: MAX_FACTORS after a
    read that found a skipped step (its residual may have failed) or where the margin's rho
    needs more."""
    if skipped:
        return MAX_FACTORS
    k = neumann_factors(min(ADAPTIVE_MARGIN * rho_max, 0.99), 2.0 * max(cond_bound, cond_trigger), dtype)
    return MAX_FACTORS if k is None else max(k, ADAPTIVE_MIN_FACTORS)


def uinv_by_products(U_new: Tensor, Uinv: Tensor, A: Tensor, c, factors: int) -> tuple[Tensor, Tensor]:
    """(U_new^-1, the Frobenius norm of the residual ``I - U_new Y`` before the Newton-Schulz
    steps), for ``U_new = c U (I - A)`` and ``Uinv`` = U^-1; ``c`` a float or a device scalar."""
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    X, P = eye + A, A
    for _ in range(factors - 1):  # X = (I + A)(I + A^2) ... (I + A^(2^(factors-1)))
        P = P @ P
        X = torch.addmm(X, X, P)
    Y = (X @ Uinv) / c
    R = torch.addmm(eye, U_new, Y, alpha=-1.0)  # I - U_new Y
    residual = torch.linalg.matrix_norm(R)
    Y = torch.addmm(Y, Y, R)
    for _ in range(NEWTON_STEPS - 1):
        Y = torch.addmm(Y, Y, torch.addmm(eye, U_new, Y, alpha=-1.0))
    return Y, residual
