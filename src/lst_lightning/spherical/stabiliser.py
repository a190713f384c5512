"""Numerical stabilisation of the factored head (section 5 of the long paper; docs/algorithm.md,
"Stabilisation"). Every repair is an exact change of (V, U, U^-1) that leaves W = V U + 1 omega^T
unchanged:

- a step whose B = c (I - A) may be nearly singular (``min |eig(B)/c| < fold_tol``, where cheap bounds
  on its eigenvalues cannot rule it out: exact_step.py's ``device_bounds``) is folded into V
  (``V <- V U B``, U = I; O(D d^2), rare) instead of ill-conditioning U;
- an upper bound on cond(U) is carried from step to step (times cond(B)); past ``cond_trigger``,
  or every ``check_every`` steps, U^-1 is recomputed and U's singular values are brought back into
  ``[sv_min, sv_max]`` (``sv_method``: ``"power"`` iteration or a full ``"svd"``), each fix a
  rank-one update, V's of one check composed and applied in one O(D d k) pass; more than
  ``max_sv_fixes`` at once fold U into V ("unfactorize"). A spectrum wholly outside the band on
  one side (weight decay scales U by c = 1 - lr weight_decay every step) is first rescaled as
  one: U / s and V s, a scalar, where a rank-one fix by so large a factor would cancel V's digits;
  the check also runs every ``decay_period`` steps where that decay, c^k, would near the
  floating-point range's end sooner than ``check_every``;
- U^-1 is recomputed every ``uinv_refresh_every`` steps (its updates drift), Q and wbar from
  (V, U, omega) every ``q_refresh_every`` steps (O(D d^2); 0: never).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .blocks import in_place_blocks
from ..heads.settings import settings_from


INVERSE_ROUTES = ("auto", "woodbury", "solve", "products")
NEUMANN_RULES = ("max", "adaptive")
#: ``woodbury=`` as it was: "always" the Woodbury update, "never" the solve
LEGACY_WOODBURY = {"always": "woodbury", "never": "solve", "auto": "auto"}


@dataclass(frozen=True)
class Stabiliser:
    """The settings of the repairs, validated on construction."""

    sv_min: float = 0.5
    sv_max: float = 2.0
    sv_method: str = "power"
    power_iters: int = 30
    cond_trigger: float = 4.0
    check_every: int = 100
    fold_tol: float = 0.05
    #: A step is folded into V on the device where cond(U)'s carried bound would pass this (the
    #: repairs that bring it back run only at the flags' reads)
    fold_cond: float = 16.0
    max_sv_fixes: int = 8
    uinv_refresh_every: int = 100
    q_refresh_every: int = 10000
    #: How the step makes H U_new^-1 (exact_step.py, inverse_update.py): a rank-m Woodbury update
    #: of U^-1 ("woodbury"), one solve with U_new's LU ("solve"), or U_new^-1 from U^-1 by
    #: d x d products alone ("products": no factorisation; capturable in a CUDA graph);
    #: "auto": products on a GPU, on a CPU Woodbury when 2 m <= d, else the solve (measured).
    inverse: str = "auto"
    #: The products route reads no rho on the host (whatever ``sync_every``; a CUDA graph's step):
    #: "adaptive" takes as many Neumann factors as four times the largest
    #: rho bound since the last read of the flags needs (at least 2; ``MAX_FACTORS`` until the
    #: first read), read with the flags, and the maximum again after a read that found a skipped
    #: step (inverse_update.py); "max" takes ``MAX_FACTORS`` every step (enough for rho up to
    #: about 0.9).
    neumann: str = "adaptive"

    def __post_init__(self):
        if not 0 < self.sv_min < 1 < self.sv_max:
            raise ValueError(f"need 0 < sv_min < 1 < sv_max, got sv_min={self.sv_min}, sv_max={self.sv_max}")
        if self.sv_method not in ("power", "svd"):
            raise ValueError(f"sv_method must be 'power' or 'svd', got {self.sv_method!r}")
        if not self.cond_trigger > 1:
            raise ValueError(f"cond_trigger must be > 1, got {self.cond_trigger}")
        if not 0 < self.fold_tol < 1:
            raise ValueError(f"fold_tol must be in (0, 1), got {self.fold_tol}")
        if not self.fold_cond > 1:
            raise ValueError(f"fold_cond must be > 1, got {self.fold_cond}")
        if self.neumann not in NEUMANN_RULES:
            raise ValueError(f"neumann must be one of {list(NEUMANN_RULES)}, got {self.neumann!r}")
        if self.inverse not in INVERSE_ROUTES:
            raise ValueError(f"inverse must be one of {list(INVERSE_ROUTES)}, got {self.inverse!r}")
        for name in ("check_every", "uinv_refresh_every", "q_refresh_every", "power_iters", "max_sv_fixes"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")

    @classmethod
    def of(cls, value: "Stabiliser | dict | None") -> "Stabiliser":
        """The settings from a Stabiliser, a dict of some of its fields (a Hydra config) or None."""
        if value is None:
            return cls()
        if isinstance(value, dict) and "woodbury" in value and "inverse" not in value:  # the setting's former name
            value = {**value, "inverse": LEGACY_WOODBURY.get(value["woodbury"], value["woodbury"])}
            del value["woodbury"]
        return settings_from(cls, value, "stabiliser")


#: The repair counters, beside ``steps`` and ``skipped_nonfinite``. ``eig_checks`` stays 0 (no step
#: computes B's eigenvalues), kept for the state dicts and logs that hold it; ``eig_failures`` counts
#: the failed SVDs of ``stabilise()``.
REPAIR_COUNTERS = ("checks", "sv_fixes", "unfactorizations", "folds", "uinv_refreshes", "q_refreshes", "eig_checks",
                   "eig_failures")


def fell_due(every: int, n_prev: int, n: int) -> bool:
    """Whether a job done every ``every`` steps (0: never) fell due between step n_prev and step n."""
    return bool(every) and n // every > n_prev // every


class Repairs:
    """The repairs of a factored head: their settings (``Stabiliser``) and their logic. The
    head holds one and calls it; the repairs change the head's buffers (V, U, U^-1, the
    conditioning bound and estimate, the warm starts) and count themselves in its counters."""

    def __init__(self, settings: Stabiliser):
        self.settings = settings

    def run_due(self, head, n_prev: int, n: int, cond_bound: float | None = None) -> None:
        """The repairs that fell due between step n_prev and step n (``cond_bound``: cond(U)'s
        bound as read with the flags; None: read here)."""
        st = self.settings
        if fell_due(st.q_refresh_every, n_prev, n):
            head.refresh_bookkeeping()
            head.q_refreshes += 1
        cond_bound = float(head.cond_bound) if cond_bound is None else cond_bound
        if fell_due(st.check_every, n_prev, n) or cond_bound > st.cond_trigger \
                or fell_due(self.decay_period(head), n_prev, n):
            self.stabilise(head)
        elif fell_due(st.uinv_refresh_every, n_prev, n) and head._uinv_fresh:
            self.refresh_uinv(head)  # Woodbury updates drift (a stale U^-1 is refreshed when next needed)

    def decay_period(self, head) -> int:
        """Every how many steps weight decay alone could take U's scale past the square root of the
        dtype's smallest normal number (1e-19 in float32), halfway in exponent to where U, and V,
        which grows as U shrinks, would leave the floating-point range: every step scales U by
        c = 1 - lr weight_decay, so c^k after k steps (0: never within ``check_every``). Only an lr
        times weight decay of about 0.35 or more (float32) needs a check sooner than every 100
        steps. From the head's lr and dtype alone, so that a resumed run checks where the saved one
        would; the check runs at the flags' reads, so no more often than every ``sync_every`` steps."""
        x = head.lr * head.weight_decay
        if x <= 0:
            return 0
        k = max(1, int(math.log(torch.finfo(head.dtype).tiny ** 0.5) / math.log1p(-x)))
        return k if not self.settings.check_every or k < self.settings.check_every else 0

    @torch.no_grad()
    def rescale(self, head, smax: float, smin: float) -> float:
        """Where U's singular values (smax to smin) all lie below the band or all above it:
        U <- U / s, U^-1 <- s U^-1 and V <- s V with s = sqrt(smax smin), which centres them on 1
        (cond(U) unchanged), W unchanged; returns s, or 1.0 (nothing done) where they do not.
        A scalar multiplies, so nothing cancels; a rank-one fix of a singular value sigma far from 1
        multiplies V's part along its direction by sigma, formed as the difference of two numbers
        near 1, and loses the digits of 1 / sigma. One O(D d) pass over V; counted as one fix."""
        if not (smax < self.settings.sv_min or smin > self.settings.sv_max):
            return 1.0
        scale = (smax * smin) ** 0.5
        for _, blk in in_place_blocks(head.V):
            blk.mul_(scale)
        head.U.div_(scale)
        head.Uinv.mul_(scale)
        head.sv_fixes += 1
        head._version += 1
        return scale

    @torch.no_grad()
    def refresh_uinv(self, head) -> None:
        head.Uinv.copy_(torch.linalg.inv(head.U))
        head._uinv_fresh = True
        head.uinv_refreshes += 1

    @torch.no_grad()
    def fold_into_v(self, head, U: Tensor) -> None:
        """V <- V U, U = U^-1 = I: W unchanged, O(D d^2)."""
        for _, blk in in_place_blocks(head.V):
            blk.copy_(blk @ U)
        eye = torch.eye(head.width, dtype=head.dtype, device=head.device)
        head.U.copy_(eye)
        head.Uinv.copy_(eye)
        head._uinv_fresh = True
        head.cond_bound.fill_(1.0)
        head.cond_estimate.fill_(1.0)
        head._version += 1

    def _rescale_directions(self, head, P: Tensor, sigma: Tensor, target: Tensor,
                            pending: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """Set U's singular values ``sigma`` (left vectors: orthonormal columns of P) to ``target``.

        U <- (I + P diag(alpha) P^T) U and U^-1 <- U^-1 (I + P diag(beta) P^T), with
        (1 + alpha)(1 + beta) = 1; V's factor (I + P diag(beta) P^T) is composed into
        ``pending`` = (A, C), V's transform I + A C A^T so far (None: I), and returned:
        ``_transform_v`` applies it in one O(D d k) pass, W = V U unchanged."""
        alpha = target / sigma - 1.0
        beta = -alpha / (1.0 + alpha)
        head.U.add_(P @ (alpha[:, None] * (P.T @ head.U)))
        head.Uinv.add_((head.Uinv @ P) @ (beta[:, None] * P.T))
        head.sv_fixes += (alpha != 0).sum()  # (a direction already in the band is a fix of 0: not counted)
        if pending is None:
            return P, torch.diag(beta)
        # (I + A C A^T)(I + P B P^T) = I + [A, P] [[C, C A^T P B], [0, B]] [A, P]^T
        A, C = pending
        k, j = C.shape[0], P.shape[1]
        top = torch.cat([C, C @ (A.T @ P) * beta[None, :]], 1)
        bottom = torch.cat([C.new_zeros(j, k), torch.diag(beta)], 1)
        return torch.cat([A, P], 1), torch.cat([top, bottom])

    @staticmethod
    def _transform_v(head, pending: tuple[Tensor, Tensor] | None) -> None:
        """V <- V (I + A C A^T): every fix of one check in one pass over V."""
        if pending is None:
            return
        A, C = pending
        CAt = C @ A.T
        for _, blk in in_place_blocks(head.V):
            blk.addmm_(blk @ A, CAt)
        head._version += 1

    def _power(self, A: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Largest singular value of A (a device scalar) and its left singular vector, warm-started at v.
        A is iterated divided by the power of two nearest its largest entry, which changes no bit
        but the exponents, so that A A^T stays within the floating-point range whatever U's scale
        (weight decay shrinks U, and U^-1 grows)."""
        e = torch.frexp(A.abs().amax()).exponent
        A = torch.ldexp(A, -e)
        v = v / v.norm().clamp_min(1e-30)
        for _ in range(self.settings.power_iters):
            w = A @ (A.T @ v)
            v = w / w.norm().clamp_min(1e-30)
        return torch.ldexp((A.T @ v).norm(), e), v

    def _extremes_on_device(self, head) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(sigma_max, its left vector, 1 / sigma_min, its left vector) of U by warm-started power
        iterations (U^-T's largest for sigma_min), on the device; the warm starts move on."""
        smax, u_max = self._power(head.U, head.u_max)
        inv_smin, u_min = self._power(head.Uinv.T, head.u_min)  # left vectors of U at sigma_min
        head.u_max.copy_(u_max)
        head.u_min.copy_(u_min)
        return smax, u_max, inv_smin, u_min

    def _extremes(self, head) -> tuple[float, float]:
        """U's largest and smallest singular values, read on the host in one transfer."""
        smax, _, inv_smin, _ = self._extremes_on_device(head)
        smax, inv_smin = torch.stack([smax, inv_smin]).tolist()
        return smax, 1.0 / inv_smin

    def _fix_one_extreme(self, head, pending):
        """Bring the smallest singular value of U to 1 where it is below sv_min, else the largest
        where it is above sv_max, else nothing (a rescale by 1): decided on the device."""
        smax, u_max, inv_smin, u_min = self._extremes_on_device(head)
        low = inv_smin * self.settings.sv_min > 1.0
        high = smax > self.settings.sv_max
        u = torch.where(low, u_min, u_max)
        sigma = torch.where(low, 1.0 / inv_smin, smax)
        target = torch.where(low | high, torch.ones_like(sigma), sigma)
        return self._rescale_directions(head, u[:, None], sigma[None], target[None], pending)

    @torch.no_grad()
    def stabilise(self, head) -> None:
        st = self.settings
        head.checks += 1
        self.refresh_uinv(head)
        lo, hi = st.sv_min, st.sv_max
        if st.sv_method == "svd":
            try:
                P, sig, _ = torch.linalg.svd(head.U)
                if not bool(torch.isfinite(sig).all()):
                    raise torch.linalg.LinAlgError("non-finite singular values")
            except RuntimeError:  # LinAlgError: fold U into V (exact, W unchanged; cond(U) 1) and count it
                head.eig_failures += 1
                self.unfactorize(head)
                return
            sig = sig / self.rescale(head, *sig[[0, -1]].tolist())  # a spectrum out on one side, as one
            bad = (sig < lo) | (sig > hi)
            k = int(bad.sum())
            if k > st.max_sv_fixes:
                self.unfactorize(head)
            elif k:
                self._transform_v(head, self._rescale_directions(head, P[:, bad], sig[bad], torch.ones_like(sig[bad]),
                                                                 None))
                self.refresh_uinv(head)
            sig = torch.linalg.svdvals(head.U)  # of U after the fixes (I after an unfactorisation)
            smax, smin = float(sig[0]), float(sig[-1])
        else:
            smax, smin = self._extremes(head)  # one host read
            scale = self.rescale(head, smax, smin)  # a spectrum out on one side, as one
            smax, smin = smax / scale, smin / scale
            if not (lo <= smin and smax <= hi):
                # up to max_sv_fixes fixes on the device, each of the extreme singular value that is
                # out of the band (a fix of 0 once both are in it): no host read between them
                pending = None
                for _ in range(st.max_sv_fixes):
                    pending = self._fix_one_extreme(head, pending)
                self._transform_v(head, pending)  # V's transform: one pass over V after the last fix
                smax, smin = self._extremes(head)  # one more host read
                if not (lo <= smin and smax <= hi):  # (V, U) as the fixes left them, then V <- V U
                    self.unfactorize(head)
                    smax = smin = 1.0
                self.refresh_uinv(head)
        head.cond_estimate.fill_(smax / smin)
        head.cond_bound.fill_(smax / smin)

    def unfactorize(self, head) -> None:
        self.fold_into_v(head, head.U.clone())
        head.unfactorizations += 1
