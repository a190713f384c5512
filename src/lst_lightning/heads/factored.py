"""The exact factored spherical head (Vincent, de Brebisson & Bouthillier).

The D x d output matrix is kept as ``W = V U + 1 omega^T`` and never formed.
Each minibatch costs O(m d^2 + m K d): the loss reads W only through
``Q = W^T W``, ``wbar = W^T 1`` and the K target rows of V, and the exact SGD
step ``W <- (1 - lr wd) W - lr dO^T H`` becomes a d x d update of U plus a
sparse update of the target rows of V. See ALGORITHM.md for the derivation;
names here follow it (row layout: H is m x d).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

import lst_kernels as lk

from .spherical import SphericalHeadBase

_CHUNK = 1 << 16  # rows of V per block in the rare O(D d^2) passes


@dataclass
class _Saved:
    Hx: Tensor
    idx: Tensor
    Hq: Tensor      # H Q
    Ht: Tensor      # H U^T
    HUinv: Tensor   # H U^-1
    ht: Tensor      # H omega
    s: Tensor       # rowsum of the output
    gq: Tensor
    gs: Tensor
    GA: Tensor


class FactoredSphericalHead(SphericalHeadBase):
    """Exact O(m d^2) training of a D-class output layer with a spherical loss.

    Stabilisation (section 5 of the long paper), all exact transformations of
    (V, U, U^-1) that leave W unchanged:

    - every step bounds the eigenvalues of ``B = c I - 2 lr H^T diag(g_q) H`` cheaply
      (O(m^2)); when the bound cannot rule out a nearly singular B, it computes them,
      and a step with ``min |eig(B)/c| < fold_tol`` is folded into V (``V <- V U B``,
      U = I; O(D d^2), rare) instead of ill-conditioning U;
    - an upper bound on cond(U) is carried from step to step (times cond(B)); when it
      exceeds ``cond_trigger``, or every ``check_every`` steps, U^-1 is recomputed and
      U's singular values are brought back into ``[sv_min, sv_max]`` (``sv_method``:
      ``"power"`` iteration or a full ``"svd"``), each fix an O(D d) rank-one update
      of V; more than ``max_sv_fixes`` at once fold U into V ("unfactorize");
    - U^-1 is recomputed every ``uinv_refresh_every`` steps (Woodbury updates drift),
      Q and wbar from (V, U, omega) every ``q_refresh_every`` steps (O(D d^2); 0: never).

    ``stats()`` returns the counters of each repair and the condition estimate.
    """

    def __init__(self, num_classes: int, hidden_dim: int, *args, init_std: float | None = None,
                 generator: torch.Generator | None = None, sv_min: float = 0.5, sv_max: float = 2.0,
                 sv_method: str = "power", power_iters: int = 30, cond_trigger: float = 4.0,
                 check_every: int = 100, fold_tol: float = 0.05, max_sv_fixes: int = 8,
                 uinv_refresh_every: int = 100, q_refresh_every: int = 10000,
                 woodbury: str = "auto", **kwargs):
        super().__init__(num_classes, hidden_dim, *args, **kwargs)
        if not 0 < sv_min < 1 < sv_max:
            raise ValueError(f"need 0 < sv_min < 1 < sv_max, got sv_min={sv_min}, sv_max={sv_max}")
        if sv_method not in ("power", "svd"):
            raise ValueError(f"sv_method must be 'power' or 'svd', got {sv_method!r}")
        if not cond_trigger > 1:
            raise ValueError(f"cond_trigger must be > 1, got {cond_trigger}")
        if not 0 < fold_tol < 1:
            raise ValueError(f"fold_tol must be in (0, 1), got {fold_tol}")
        if woodbury not in ("auto", "always", "never"):
            raise ValueError(f"woodbury must be 'auto', 'always' or 'never', got {woodbury!r}")
        for name, v in (("check_every", check_every), ("uinv_refresh_every", uinv_refresh_every),
                        ("q_refresh_every", q_refresh_every), ("power_iters", power_iters),
                        ("max_sv_fixes", max_sv_fixes)):
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.sv_min, self.sv_max, self.sv_method = float(sv_min), float(sv_max), sv_method
        self.power_iters, self.cond_trigger, self.check_every = power_iters, float(cond_trigger), check_every
        self.fold_tol, self.max_sv_fixes, self.woodbury = float(fold_tol), max_sv_fixes, woodbury
        self.uinv_refresh_every, self.q_refresh_every = uinv_refresh_every, q_refresh_every

        D, d = num_classes, self.width
        fk = {k: v for k, v in self._factory.items() if v is not None}
        std = init_std if init_std is not None else d ** -0.5
        V = torch.randn(D, d, generator=generator, dtype=self.dtype) * std
        self.register_buffer("V", V.to(**fk))
        self.register_buffer("U", torch.eye(d, **fk))
        self.register_buffer("Uinv", torch.eye(d, **fk))
        self.register_buffer("omega", torch.zeros(d, **fk))
        self.register_buffer("Q", torch.zeros(d, d, **fk))
        self.register_buffer("wbar", torch.zeros(d, **fk))
        self._register_buffers_common()
        f64 = {"dtype": torch.float64, "device": fk.get("device")}
        # Warm starts of the power iterations for U's largest and smallest singular values.
        g = torch.Generator().manual_seed(0)
        self.register_buffer("u_max", torch.randn(d, generator=g, dtype=self.dtype).to(**fk))
        self.register_buffer("u_min", torch.randn(d, generator=g, dtype=self.dtype).to(**fk))
        self.register_buffer("uinv_fresh", torch.ones((), dtype=torch.bool, device=fk.get("device")))
        self.register_buffer("cond_bound", torch.ones((), **f64))     # >= cond(U), carried
        self.register_buffer("cond_estimate", torch.ones((), **f64))  # measured at the last check
        for name in ("checks", "sv_fixes", "unfactorizations", "folds", "uinv_refreshes",
                     "q_refreshes", "eig_checks"):
            self.register_buffer(name, torch.zeros((), dtype=torch.long, device=fk.get("device")))
        self.refresh_bookkeeping()

    @property
    def device(self) -> torch.device:
        return self.V.device

    # -- the implicit W -------------------------------------------------------------------
    @torch.no_grad()
    def weight(self) -> Tensor:
        W = torch.empty_like(self.V)
        for a in range(0, self.num_classes, _CHUNK):
            torch.addmm(self.omega, self.V[a:a + _CHUNK], self.U, out=W[a:a + _CHUNK])
        return W

    @torch.no_grad()
    def reset_weight(self, W: Tensor) -> None:
        """Make the implicit W equal to W: V = W, U = U^-1 = I, omega = 0, O(D d^2) bookkeeping."""
        if not isinstance(W, Tensor) or tuple(W.shape) != (self.num_classes, self.width):
            raise ValueError(f"W must have shape {(self.num_classes, self.width)}, got "
                             f"{tuple(W.shape) if isinstance(W, Tensor) else type(W).__name__}")
        if not torch.isfinite(W).all():
            raise ValueError("W has non-finite entries")
        self.V.copy_(W)
        self.U.copy_(torch.eye(self.width, dtype=self.dtype, device=self.device))
        self.Uinv.copy_(self.U)
        self.uinv_fresh.fill_(True)
        self.omega.zero_()
        self.cond_bound.fill_(1.0)
        self.cond_estimate.fill_(1.0)
        self.refresh_bookkeeping()

    @torch.no_grad()
    def refresh_bookkeeping(self) -> None:
        """Recompute Q = W^T W and wbar = W^T 1 exactly from (V, U, omega): O(D d^2)."""
        VtV = torch.zeros_like(self.Q)
        v1 = torch.zeros_like(self.wbar)
        for a in range(0, self.num_classes, _CHUNK):
            blk = self.V[a:a + _CHUNK]
            VtV.addmm_(blk.T, blk)
            v1 += blk.sum(0)
        U, w = self.U, self.omega
        Utv = U.T @ v1
        Q = U.T @ VtV @ U + torch.outer(Utv, w) + torch.outer(w, Utv) + self.num_classes * torch.outer(w, w)
        self.Q.copy_(0.5 * (Q + Q.T))
        self.wbar.copy_(Utv + self.num_classes * w)
        self._version += 1

    # -- forward ----------------------------------------------------------------------------
    def _outputs(self, Hx: Tensor, idx: Tensor | None, with_uinv: bool = False):
        """q, s, the target outputs A and the products reused by backward."""
        d = self.width
        mats = [self.Q, self.U.T] + ([self.Uinv] if with_uinv else [])
        P = Hx @ torch.cat(mats, dim=1)  # one GEMM for H Q, H U^T (and H U^-1)
        Hq, Ht = P[:, :d], P[:, d:2 * d]
        HUinv = P[:, 2 * d:] if with_uinv else None
        q = (Hx * Hq).sum(1)
        s = Hx @ self.wbar
        ht = Hx @ self.omega
        A = lk.gather_dot(self.V, idx, Ht, ht) if idx is not None else None
        return q, s, A, Hq, Ht, HUinv, ht

    @torch.no_grad()
    def _eval_loss(self, Hx, idx, T):
        q, s, A, *_ = self._outputs(Hx, idx)
        return self.reduce(self.loss_fn(q, s, A, T, num_classes=self.num_classes, y_sq=self.y_sq(idx, T)))

    def _use_woodbury(self, m: int) -> bool:
        # Woodbury costs m^2 d + m^3, a fresh solve with U d^3 + m d^2: measured crossover near m = d/2.
        return self.woodbury == "always" or (self.woodbury == "auto" and 2 * m <= self.width)

    @torch.no_grad()
    def _forward_step(self, Hx, idx, T):
        woodbury = self._use_woodbury(Hx.shape[0])
        if woodbury and not bool(self.uinv_fresh):
            self._refresh_uinv()  # the last steps solved with U directly and left U^-1 behind
        q, s, A, Hq, Ht, HUinv, ht = self._outputs(Hx, idx, with_uinv=woodbury)
        L, gq, gs, GA = self.loss_and_grads(q, s, A, T, self.y_sq(idx, T))
        return L, _Saved(Hx, idx, Hq, Ht, HUinv, ht, s, gq, gs, GA)

    # -- backward and the exact update ------------------------------------------------------
    @torch.no_grad()
    def _backward_step(self, sv: _Saved, grad_out: Tensor) -> Tensor:
        Hx, idx = sv.Hx, sv.idx
        gq, gs, GA = sv.gq * grad_out, sv.gs * grad_out, sv.GA * grad_out
        ybar = GA.sum(1)
        # dH = dO W without dO: Z = (g_s 1^T + Yd) W.
        Z = lk.gather_sum(self.V, idx, GA) @ self.U + torch.outer(ybar, self.omega) + torch.outer(gs, self.wbar)
        dH = torch.addcmul(Z, gq[:, None], sv.Hq, value=2.0)
        if not math.isfinite(float(Hx.sum() + gq.sum() + gs.sum() + GA.sum())):
            self._skip("hidden states or loss gradients")
            return torch.zeros_like(dH)
        new = self._new_state(sv, gq, gs, GA, ybar, Z, dH)
        if new is None:
            self._skip("state after the step")
            return torch.zeros_like(dH)
        self._commit(sv, GA, new)
        return dH

    def _new_state(self, sv: _Saved, gq, gs, GA, ybar, Z, dH) -> dict | None:
        """Everything the step changes, computed aside so a failure leaves the head untouched."""
        Hx, lr = sv.Hx, self.lr
        m = Hx.shape[0]
        c = 1.0 - lr * self.weight_decay  # > 0: forward checked lr * weight_decay < 1
        kappa = (2.0 * lr / c) * gq  # B = c (I - H^T diag(kappa) H)
        use_woodbury = sv.HUinv is not None
        G = Hx @ Hx.T if use_woodbury else None
        lam_lo, lam_hi, exact = self._step_eigen_bounds(Hx, G, kappa)
        fold = exact and lam_lo < self.fold_tol
        U_new = torch.addmm(self.U, sv.Ht.T, gq[:, None] * Hx, beta=c, alpha=-2.0 * lr)  # U B, reusing H U^T
        omega_new = c * self.omega - lr * (Hx.T @ (2.0 * gq * sv.ht + gs))
        if fold:
            Uinv_new, HUinv_new = None, Hx  # V absorbs U B; U = U^-1 = I
        elif use_woodbury:
            # B^-1 = (1/c)(I - H^T C (I_m + H H^T C)^-1 H), C = -diag(kappa): no division by g_q.
            S = torch.eye(m, dtype=Hx.dtype, device=Hx.device) - G * kappa[None, :]
            R = torch.linalg.solve(S, sv.HUinv)
            KR = kappa[:, None] * R
            Uinv_new = (self.Uinv + Hx.T @ KR) / c
            HUinv_new = (sv.HUinv + G @ KR) / c
        else:  # H U_new^-1 by one solve; U^-1 itself is left stale until it is needed
            Uinv_new, HUinv_new = None, torch.linalg.solve(U_new, Hx, left=False)
        # M = dO dO^T (m x m) and the exact bookkeeping of Q = W^T W and wbar = W^T 1.
        M = lk.m_matrix(sv.Hq, Hx, Z, gq, gs, ybar, self.num_classes, lk.sparse_gram(sv.idx, GA))
        Q_new = lk.q_update(self.Q, Hx, dH, M, lr, c)
        wbar_new = c * self.wbar - lr * (Hx.T @ (2.0 * gq * sv.s + self.num_classes * gs + ybar))
        parts = [U_new, omega_new, HUinv_new, Q_new, wbar_new] + ([Uinv_new] if Uinv_new is not None else [])
        if not math.isfinite(float(sum(t.sum() for t in parts))):  # NaN and inf survive a sum
            return None
        return {"U": U_new, "Uinv": Uinv_new, "omega": omega_new, "Q": Q_new, "wbar": wbar_new,
                "HUinv": HUinv_new, "fold": fold, "cond_step": lam_hi / lam_lo if lam_lo > 0 else float("inf")}

    def _step_eigen_bounds(self, Hx: Tensor, G: Tensor | None, kappa: Tensor) -> tuple[float, float, bool]:
        """Bounds (lo, hi) on |eigenvalues| of B/c = I - H^T diag(kappa) H, and whether they are exact.

        Tiered, cheapest first: the largest eigenvalue of H^T diag(w) H (w >= 0) is at most
        its trace sum(w ||h||^2) (O(m d)), and at most its Frobenius norm (O(m^2) with
        G = H H^T at hand, else O(m d^2)). Only when neither rules out an eigenvalue of
        B/c below 1/2 are the eigenvalues computed (O(min(m, d)^3): large steps only)."""
        sq = Hx.pow(2).sum(1) if G is None else G.diagonal()
        rho = []
        for w in (kappa.clamp(min=0), (-kappa).clamp(min=0)):
            r = float(w @ sq)
            if r > 0.05:  # the trace bound is loose by up to a factor min(m, d): tighten it
                if G is not None:
                    sw = w.sqrt()
                    r = float(torch.linalg.matrix_norm(G * sw[:, None] * sw[None, :]))
                else:
                    X = w.sqrt()[:, None] * Hx
                    r = float(torch.linalg.matrix_norm(X.T @ X))
            rho.append(r)
        if rho[0] <= 0.5:
            return 1.0 - rho[0], 1.0 + rho[1], False
        self.eig_checks += 1
        m, d = Hx.shape
        if G is not None:  # nonzero eigenvalues of H^T diag(kappa) H are those of diag(kappa) G
            ev = torch.linalg.eigvals(kappa[:, None] * G).real
            ev = torch.cat([ev, ev.new_zeros(1)]) if m < d else ev
        else:
            ev = torch.linalg.eigvalsh((kappa[:, None] * Hx).T @ Hx)
        lam = (1.0 - ev).abs()
        return float(lam.min()), float(lam.max()), True

    def _commit(self, sv: _Saved, GA: Tensor, new: dict) -> None:
        if new["fold"]:
            self._fold_into_v(new["U"])
            self.folds += 1
        else:
            self.U.copy_(new["U"])
            if new["Uinv"] is not None:
                self.Uinv.copy_(new["Uinv"])
            else:
                self.uinv_fresh.fill_(False)
        lk.scatter_add_rows_(self.V, sv.idx, GA, new["HUinv"], -self.lr)
        self.omega.copy_(new["omega"])
        self.Q.copy_(0.5 * (new["Q"] + new["Q"].T))
        self.wbar.copy_(new["wbar"])
        self.steps += 1
        self._version += 1
        if not new["fold"]:
            self.cond_bound *= new["cond_step"]
        self._maintain()

    # -- stabilisation ----------------------------------------------------------------------
    def _maintain(self) -> None:
        n = int(self.steps)
        if self.q_refresh_every and n % self.q_refresh_every == 0:
            self.refresh_bookkeeping()
            self.q_refreshes += 1
        due = self.check_every and n % self.check_every == 0
        if due or float(self.cond_bound) > self.cond_trigger:
            self.stabilise()
        elif self.uinv_refresh_every and n % self.uinv_refresh_every == 0 and bool(self.uinv_fresh):
            self._refresh_uinv()  # Woodbury updates drift (a stale U^-1 is refreshed when next needed)

    @torch.no_grad()
    def _refresh_uinv(self) -> None:
        self.Uinv.copy_(torch.linalg.inv(self.U))
        self.uinv_fresh.fill_(True)
        self.uinv_refreshes += 1

    @torch.no_grad()
    def _fold_into_v(self, U: Tensor) -> None:
        """V <- V U, U = U^-1 = I: W unchanged, O(D d^2)."""
        for a in range(0, self.num_classes, _CHUNK):
            self.V[a:a + _CHUNK] = self.V[a:a + _CHUNK] @ U
        eye = torch.eye(self.width, dtype=self.dtype, device=self.device)
        self.U.copy_(eye)
        self.Uinv.copy_(eye)
        self.uinv_fresh.fill_(True)
        self.cond_bound.fill_(1.0)
        self.cond_estimate.fill_(1.0)
        self._version += 1

    def _rescale_directions(self, P: Tensor, sigma: Tensor, target: Tensor) -> None:
        """Set U's singular values ``sigma`` (left vectors: columns of P) to ``target``.

        U <- (I + P diag(alpha) P^T) U, V and U^-1 <- X (I + P diag(beta) P^T), with
        (1 + alpha)(1 + beta) = 1, so W = V U is unchanged; O(D d k) for k columns."""
        alpha = target / sigma - 1.0
        beta = -alpha / (1.0 + alpha)
        self.U.add_(P @ (alpha[:, None] * (P.T @ self.U)))
        self.Uinv.add_((self.Uinv @ P) @ (beta[:, None] * P.T))
        for a in range(0, self.num_classes, _CHUNK):
            blk = self.V[a:a + _CHUNK]
            blk.add_((blk @ P) @ (beta[:, None] * P.T))
        self.sv_fixes += P.shape[1]
        self._version += 1

    def _power(self, A: Tensor, v: Tensor) -> tuple[float, Tensor]:
        """Largest singular value of A and its left singular vector, warm-started at v."""
        v = v / v.norm().clamp_min(1e-30)
        for _ in range(self.power_iters):
            w = A @ (A.T @ v)
            v = w / w.norm().clamp_min(1e-30)
        return float((A.T @ v).norm()), v

    @torch.no_grad()
    def stabilise(self) -> None:
        """Recompute U^-1, then bring U's singular values into [sv_min, sv_max] (exact, W unchanged)."""
        self.checks += 1
        self._refresh_uinv()
        lo, hi = self.sv_min, self.sv_max
        if self.sv_method == "svd":
            P, sig, _ = torch.linalg.svd(self.U)
            bad = (sig < lo) | (sig > hi)
            k = int(bad.sum())
            if k > self.max_sv_fixes:
                self._unfactorize()
            elif k:
                self._rescale_directions(P[:, bad], sig[bad], torch.ones_like(sig[bad]))
                self._refresh_uinv()
            _, sig, _ = torch.linalg.svd(self.U)
            smax, smin = float(sig[0]), float(sig[-1])
        else:
            fixes = 0
            while True:
                smax, u_max = self._power(self.U, self.u_max)
                inv_smin, u_min = self._power(self.Uinv.T, self.u_min)  # left vectors of U at sigma_min
                smin = 1.0 / inv_smin
                self.u_max.copy_(u_max)
                self.u_min.copy_(u_min)
                if lo <= smin and smax <= hi:
                    break
                if fixes >= self.max_sv_fixes:
                    self._unfactorize()
                    smax = smin = 1.0
                    break
                u, sigma = (u_min, smin) if smin < lo else (u_max, smax)
                one = torch.ones(1, dtype=self.dtype, device=self.device)
                self._rescale_directions(u[:, None], one * sigma, one)
                fixes += 1
            if fixes:
                self._refresh_uinv()
        self.cond_estimate.fill_(smax / smin)
        self.cond_bound.fill_(smax / smin)

    def _unfactorize(self) -> None:
        self._fold_into_v(self.U.clone())
        self.unfactorizations += 1

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """O[:, start:end] = (H U^T) V[start:end]^T + H omega: O(m (end - start) d)."""
        Hx, _, _ = self.prepare(hidden)
        return torch.addmm((Hx @ self.omega)[:, None], Hx @ self.U.T, self.V[start:end].T)

    @torch.no_grad()
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """log p(target) in O(d^2) per example (spherical and Taylor softmax)."""
        Hx, idx, _ = self.prepare(hidden, target_idx)
        q, s, A, *_ = self._outputs(Hx, idx)
        logp = self.loss_fn.log_prob(q, s, A, num_classes=self.num_classes).masked_fill(idx < 0, 0.0)
        return logp[:, 0] if target_idx.dim() == 1 else logp

    def stats(self) -> dict[str, float]:
        """Counters of every repair and the conditioning of U, for logging."""
        names = ("steps", "skipped_nonfinite", "checks", "sv_fixes", "unfactorizations", "folds",
                 "uinv_refreshes", "q_refreshes", "eig_checks")
        out: dict[str, float] = {n: int(getattr(self, n)) for n in names}
        out["cond_estimate"] = float(self.cond_estimate)
        out["cond_bound"] = float(self.cond_bound)
        return out
