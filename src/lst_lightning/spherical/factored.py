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
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

import lst_kernels as lk

from ..heads.base import count_at_or_above, target_scores_of_chunks, topk_of_chunks
from .collectives import ProcessGroup, bit_hash
from .base import SphericalHeadBase

_CHUNK = 1 << 16  # rows of V per block in the rare O(D d^2) passes


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
    input_ok: Tensor | None = None  # deferred checks: False when the batch had bad target ids


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

    Multi-process training (``parallel``; call ``distribute()`` on every rank once
    torch.distributed is up, or let the first forward do it):

    - ``"replicated"``: every rank holds the whole head; each training step all-gathers
      H and the targets, so every rank applies the same global update, bit for bit
      (checked by a hash of the state every ``checksum_every`` steps);
    - ``"sharded"``: rank r holds V's rows for classes ``[row_lo, row_hi)``; U, U^-1,
      omega, Q and wbar are replicated. The gather-dot and gather-sum are all-reduced
      (m K and m d values) and each rank scatters into its own rows only.

    Either way each rank gets ``world x dL/dH`` for its own rows, so that DDP's
    averaging of the body's gradients gives the gradient of the global-batch loss.
    """

    def __init__(self, num_classes: int, hidden_dim: int, *args, init_std: float | None = None,
                 generator: torch.Generator | None = None, sv_min: float = 0.5, sv_max: float = 2.0,
                 sv_method: str = "power", power_iters: int = 30, cond_trigger: float = 4.0,
                 check_every: int = 100, fold_tol: float = 0.05, max_sv_fixes: int = 8,
                 uinv_refresh_every: int = 100, q_refresh_every: int = 10000,
                 woodbury: str = "auto", parallel: str = "none", checksum_every: int = 100,
                 sync_every: int = 1, **kwargs):
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
        if parallel not in ("none", "replicated", "sharded"):
            raise ValueError(f"parallel must be 'none', 'replicated' or 'sharded', got {parallel!r}")
        if not (isinstance(sync_every, int) and sync_every >= 1):
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        for name, v in (("check_every", check_every), ("checksum_every", checksum_every), ("uinv_refresh_every", uinv_refresh_every),
                        ("q_refresh_every", q_refresh_every), ("power_iters", power_iters),
                        ("max_sv_fixes", max_sv_fixes)):
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.sv_min, self.sv_max, self.sv_method = float(sv_min), float(sv_max), sv_method
        self.power_iters, self.cond_trigger, self.check_every = power_iters, float(cond_trigger), check_every
        self.fold_tol, self.max_sv_fixes, self.woodbury = float(fold_tol), max_sv_fixes, woodbury
        self.uinv_refresh_every, self.q_refresh_every = uinv_refresh_every, q_refresh_every
        self.parallel, self.checksum_every = parallel, checksum_every
        self.sync_every = sync_every
        self._calls = 0          # training steps run (host count: no device read)
        self._synced = (0, 0)    # (steps, skipped) at the last host read
        self._pg = ProcessGroup()
        self._distributed = parallel == "none"

        D, d = num_classes, self.width
        fk = {k: v for k, v in self._factory.items() if v is not None}
        # V's rows are drawn chunk by chunk from one seed, so that a shard can be made
        # alone (a sharded head never holds all of V) and equals the same rows unsharded.
        self._init_std = init_std if init_std is not None else d ** -0.5
        self._init_seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        #: V holds the rows of classes [row_lo, row_hi): all of them unless sharded.
        self.row_lo, self.row_hi = 0, (0 if parallel == "sharded" else D)
        self.register_buffer("V", self._init_rows(self.row_lo, self.row_hi, fk.get("device")).to(**fk))
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
        self._uinv_fresh = True  # host-side: the forward must not read a device flag
        self.register_buffer("_lr_t", torch.zeros((), **fk), persistent=False)
        self._lr_filled = None
        self.register_buffer("_bad_input", torch.zeros((), dtype=torch.bool, device=fk.get("device")),
                             persistent=False)
        self.register_buffer("cond_bound", torch.ones((), **f64))     # >= cond(U), carried
        self.register_buffer("cond_estimate", torch.ones((), **f64))  # measured at the last check
        for name in ("checks", "sv_fixes", "unfactorizations", "folds", "uinv_refreshes",
                     "q_refreshes", "eig_checks"):
            self.register_buffer(name, torch.zeros((), dtype=torch.long, device=fk.get("device")))
        if self._distributed:
            self.refresh_bookkeeping()

    @property
    def device(self) -> torch.device:
        return self.V.device

    def _init_rows(self, lo: int, hi: int, device=None) -> Tensor:
        """Rows lo:hi of the initial V: chunk c of rows comes from seed + c, drawn on the
        device itself (a GPU's generator gives other numbers than the CPU's, as it should:
        at D = 20M, d = 512 a host draw takes a minute)."""
        out = torch.empty(hi - lo, self.width, dtype=self.dtype, device=device)
        for c in range(lo // _CHUNK, -(-hi // _CHUNK)):
            a, b = c * _CHUNK, min((c + 1) * _CHUNK, self.num_classes)
            g = torch.Generator(device=out.device).manual_seed(self._init_seed + c)
            blk = torch.randn(b - a, self.width, generator=g, dtype=self.dtype, device=out.device)
            s, e = max(a, lo), min(b, hi)
            out[s - lo:e - lo] = blk[s - a:e - a] * self._init_std
        return out

    # -- multi-process ----------------------------------------------------------------------
    _SHARED = ("U", "Uinv", "omega", "Q", "wbar", "u_max", "u_min", "cond_bound", "cond_estimate",
               "steps", "skipped_nonfinite", "checks", "sv_fixes", "unfactorizations", "folds",
               "uinv_refreshes", "q_refreshes", "eig_checks")

    @property
    def deferred_checks(self) -> bool:
        """True with ``sync_every > 1``: the training step never waits for the device; its
        checks raise device flags that ``sync()`` reads every ``sync_every`` steps."""
        return self.sync_every > 1

    @property
    def uinv_fresh(self) -> bool:
        """Whether U^-1 is up to date (steps that solve with U leave it behind)."""
        return self._uinv_fresh

    def get_extra_state(self):
        return {**super().get_extra_state(), "uinv_fresh": self._uinv_fresh}

    def set_extra_state(self, state) -> None:
        super().set_extra_state(state)
        self._uinv_fresh = bool(state.get("uinv_fresh", False))  # unknown: refresh when needed
        self._synced = (int(self.steps), int(self.skipped_nonfinite))  # buffers load before extra state

    @property
    def sharded(self) -> bool:
        return self.parallel == "sharded"

    @torch.no_grad()
    def distribute(self, process_group=None) -> None:
        """Join the ranks of ``process_group`` (default: the whole world; alone when
        torch.distributed is not initialised). Every rank must call it: rank 0's state
        is taken by all (its V rows, for a shard); a sharded head makes its own rows."""
        if self.parallel == "none":
            return
        pg = ProcessGroup.current(process_group)
        if self._distributed and (pg.rank, pg.world) == (self._pg.rank, self._pg.world):
            return
        if self._distributed and self.sharded and self._pg.world > 1:
            raise RuntimeError("a sharded head cannot be re-distributed over another group")
        dev, D = self.device, self.num_classes
        for name in self._SHARED:
            pg.broadcast_(getattr(self, name))
        self._init_seed = int(pg.all_gather_ints([self._init_seed], dev)[0, 0])
        same_v = False
        if self.V.shape[0] == D:
            h = bit_hash([self.V])
            same_v = bool((pg.all_gather_ints([h], dev) == h).all())
        if self.parallel == "replicated":
            if not same_v:
                pg.broadcast_(self.V)
        else:
            lo, hi = self._shard_rows(pg.rank, pg.world)
            if same_v:
                self.V = self.V[lo:hi].clone()
            elif self.V.shape[0] == 0 and not int(self.steps):
                self.V = self._init_rows(lo, hi, dev)
            else:
                raise RuntimeError("the ranks hold different V: distribute() a sharded head before training it")
            self.row_lo, self.row_hi = lo, hi
        self._pg, self._distributed = pg, True
        self.refresh_bookkeeping()  # also bumps the version: no stale backward survives this

    def _shard_rows(self, rank: int, world: int) -> tuple[int, int]:
        """The classes [lo, hi) whose rows of V rank ``rank`` of ``world`` holds when sharded."""
        per = -(-self.num_classes // world)
        return min(rank * per, self.num_classes), min((rank + 1) * per, self.num_classes)

    def _ensure_distributed(self) -> None:
        if not self._distributed:
            self.distribute()

    def _prepare_everywhere(self, H, target_idx, target_val, step: bool | None = None):
        self._ensure_distributed()
        step = self.in_training_step if step is None else step
        if not (self._pg.world > 1 and (self.sharded or step)):
            return self.prepare(H, target_idx, target_val, step=step)
        try:
            out, err = self.prepare(H, target_idx, target_val, step=step), None
        except (ValueError, TypeError) as e:
            out, err = None, e
        if self._pg.any(err is not None, self.device):  # all ranks raise, none has changed
            raise err if err is not None else ValueError(
                "another rank's input to the head was invalid (its error says why); no rank changed state")
        return out

    def _collect(self, Hx, idx, T, training):
        if self._pg.world == 1 or not (training or self.sharded):
            return Hx, idx, T, None
        (Hx, idx, T), rows = self._pg.gather_rows([Hx, idx, T], [0.0, -1, 0.0])
        return Hx, idx, T, rows

    def _own_rows(self, dH, rows):
        return dH if rows is None else dH[rows] * self._pg.world

    def _local_idx(self, idx: Tensor) -> Tensor:
        if not self.sharded:
            return idx
        inside = (idx >= self.row_lo) & (idx < self.row_hi)
        return torch.where(inside, idx - self.row_lo, -1)

    def _gather_dot(self, idx: Tensor, X: Tensor, x0: Tensor) -> Tensor:
        if not self.sharded:
            return lk.gather_dot(self.V, idx, X, x0)
        A = self._pg.all_reduce_(lk.gather_dot(self.V, self._local_idx(idx), X))  # one owner per slot
        return torch.where(idx >= 0, A + x0[:, None], 0.0)

    def _gather_sum(self, idx: Tensor, G: Tensor) -> Tensor:
        if not self.sharded:
            return lk.gather_sum(self.V, idx, G)
        return self._pg.all_reduce_(lk.gather_sum(self.V, self._local_idx(idx), G))

    @torch.no_grad()
    def gather_v(self, dst: int = 0) -> Tensor | None:
        """All of V on rank ``dst`` (on the host), None on the other ranks; every rank must
        call it. A checkpoint holding it loads into a head sharded over any number of ranks."""
        if not self.sharded or self._pg.world == 1:
            return self.V.cpu()
        out = torch.empty(self.num_classes, self.width, dtype=self.dtype) if self._pg.rank == dst else None
        for r in range(self._pg.world):  # one shard at a time: rank dst holds V once, not twice
            lo, hi = self._shard_rows(r, self._pg.world)
            buf = self.V if r == self._pg.rank else self.V.new_empty(hi - lo, self.width)
            self._pg.broadcast_(buf, src=r)
            if out is not None:
                out[lo:hi] = buf.cpu()
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        V = state_dict.get(prefix + "V")
        if self.sharded and V is not None and V.shape[0] == self.num_classes != self.V.shape[0]:
            self._ensure_distributed()  # a whole V (from gather_v): keep this rank's rows
            state_dict = {**state_dict, prefix + "V": V[self.row_lo:self.row_hi]}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def state_hash(self) -> int:
        """A hash of the bits of the state every rank must hold alike (V too unless sharded)."""
        names = self._SHARED + (() if self.sharded else ("V",))
        return bit_hash([getattr(self, n) for n in names])

    def check_replicas(self) -> None:
        """Raise on every rank when the ranks' shared state differs in any bit."""
        if self._pg.world == 1:
            return
        h = self._pg.all_gather_ints([self.state_hash()], self.device)[:, 0]
        if not bool((h == h[0]).all()):
            raise RuntimeError(f"{type(self).__name__}: the replicas diverged by step {int(self.steps)} "
                               f"(state hashes per rank: {h.tolist()}). Same inputs and deterministic "
                               "kernels keep them equal: did a rank get another lr or another batch?")

    # -- the implicit W -------------------------------------------------------------------
    @torch.no_grad()
    def weight(self) -> Tensor:
        """The implicit W: its rows row_lo:row_hi when sharded."""
        self._ensure_distributed()
        W = torch.empty_like(self.V)
        for a in range(0, self.V.shape[0], _CHUNK):
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
        self._ensure_distributed()
        self.V.copy_(W[self.row_lo:self.row_hi])
        self.U.copy_(torch.eye(self.width, dtype=self.dtype, device=self.device))
        self.Uinv.copy_(self.U)
        self._uinv_fresh = True
        self.omega.zero_()
        self.cond_bound.fill_(1.0)
        self.cond_estimate.fill_(1.0)
        self.refresh_bookkeeping()

    @torch.no_grad()
    def refresh_bookkeeping(self) -> None:
        """Recompute Q = W^T W and wbar = W^T 1 exactly from (V, U, omega): O(D d^2)."""
        VtV = torch.zeros_like(self.Q)
        v1 = torch.zeros_like(self.wbar)
        for a in range(0, self.V.shape[0], _CHUNK):
            blk = self.V[a:a + _CHUNK]
            VtV.addmm_(blk.T, blk)
            v1 += blk.sum(0)
        if self.sharded:
            self._pg.all_reduce_(VtV)
            self._pg.all_reduce_(v1)
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
        A = self._gather_dot(idx, Ht, ht) if idx is not None else None
        return q, s, A, Hq, Ht, HUinv, ht

    @torch.no_grad()
    def _eval_loss(self, Hx, idx, T):
        Hx, idx, T, rows = self._collect(Hx, idx, T, training=False)
        q, s, A, *_ = self._outputs(Hx, idx)
        per_example = self.loss_fn(q, s, A, T, num_classes=self.num_classes, y_sq=self.y_sq(idx, T))
        return self.reduce(per_example if rows is None else per_example[rows])

    def _use_woodbury(self, m: int) -> bool:
        # Woodbury costs m^2 d + m^3, a fresh solve with U d^3 + m d^2: measured crossover near m = d/2.
        return self.woodbury == "always" or (self.woodbury == "auto" and 2 * m <= self.width)

    @torch.no_grad()
    def _forward_step(self, Hx, idx, T):
        input_ok = None
        if self.deferred_checks:  # bad ids become padding; the step is void, the error comes later
            bad = (idx < -1) | (idx >= self.num_classes)
            input_ok = ~bad.any()
            self._bad_input |= ~input_ok
            idx, T = torch.where(bad, -1, idx), torch.where(bad, 0.0, T)
        woodbury = self._use_woodbury(Hx.shape[0])
        if woodbury and not self._uinv_fresh:
            self._refresh_uinv()  # the last steps solved with U directly and left U^-1 behind
        q, s, A, Hq, Ht, HUinv, ht = self._outputs(Hx, idx, with_uinv=woodbury)
        L, gq, gs, GA = self.loss_and_grads(q, s, A, T, self.y_sq(idx, T))
        return L, _Saved(Hx, idx, Hq, Ht, HUinv, ht, s, gq, gs, GA, input_ok)

    # -- backward and the exact update ------------------------------------------------------
    @torch.no_grad()
    def _backward_step(self, sv: _Saved, grad_out: Tensor) -> Tensor:
        Hx, idx = sv.Hx, sv.idx
        gq, gs, GA = sv.gq * grad_out, sv.gs * grad_out, sv.GA * grad_out
        ybar = GA.sum(1)
        # dH = dO W without dO: Z = (g_s 1^T + Yd) W.
        Z = self._gather_sum(idx, GA) @ self.U + torch.outer(ybar, self.omega) + torch.outer(gs, self.wbar)
        dH = torch.addcmul(Z, gq[:, None], sv.Hq, value=2.0)
        finite = torch.isfinite(Hx.sum() + gq.sum() + gs.sum() + GA.sum())
        if self.deferred_checks:
            return self._deferred_update(sv, gq, gs, GA, ybar, Z, dH, finite)
        if not bool(finite):
            self._skip("hidden states or loss gradients")
            return torch.zeros_like(dH)
        new = self._new_state(sv, gq, gs, GA, ybar, Z, dH)
        if not bool(new["ok"]):
            self._skip("state after the step")
            return torch.zeros_like(dH)
        self._commit(sv, GA, new)
        return dH

    def _new_state(self, sv: _Saved, gq, gs, GA, ybar, Z, dH) -> dict:
        """Everything the step changes, computed aside so a failure leaves the head untouched;
        ``ok`` (a device bool) says whether all of it is finite."""
        Hx = sv.Hx
        lr = self._lr_device() if self.deferred_checks else self.lr  # a captured graph reads it each replay
        m = Hx.shape[0]
        c = 1.0 - lr * self.weight_decay  # > 0: forward checked lr * weight_decay < 1
        kappa = (2.0 * lr / c) * gq  # B = c (I - H^T diag(kappa) H)
        use_woodbury = sv.HUinv is not None
        G = Hx @ Hx.T if use_woodbury else None
        if self.deferred_checks:  # bounds stay on the device; a nearly singular B is repaired later
            rho_pos, rho_neg = self._rho_bounds(Hx, G, kappa)
            fold = False
            cond_step = torch.where(rho_pos < 1, (1 + rho_neg) / (1 - rho_pos).clamp_min(1e-30), math.inf)
        else:
            lam_lo, lam_hi, exact = self._step_eigen_bounds(Hx, G, kappa)
            fold = exact and lam_lo < self.fold_tol
            cond_step = lam_hi / lam_lo if lam_lo > 0 else float("inf")
        U_new = torch.addmm(c * self.U, sv.Ht.T, (-2.0 * lr) * gq[:, None] * Hx)  # U B, reusing H U^T
        omega_new = c * self.omega - lr * (Hx.T @ (2.0 * gq * sv.ht + gs))
        info = None
        if fold:
            Uinv_new, HUinv_new = None, Hx  # V absorbs U B; U = U^-1 = I
        elif use_woodbury:
            # B^-1 = (1/c)(I - H^T C (I_m + H H^T C)^-1 H), C = -diag(kappa): no division by g_q.
            S = torch.eye(m, dtype=Hx.dtype, device=Hx.device) - G * kappa[None, :]
            R, info = torch.linalg.solve_ex(S, sv.HUinv)  # _ex: a singular S is a flag, not a sync
            KR = kappa[:, None] * R
            Uinv_new = (self.Uinv + Hx.T @ KR) / c
            HUinv_new = (sv.HUinv + G @ KR) / c
        else:  # H U_new^-1 by one solve; U^-1 itself is left stale until it is needed
            HUinv_new, info = torch.linalg.solve_ex(U_new, Hx, left=False)
            Uinv_new = None
        # M = dO dO^T (m x m) and the exact bookkeeping of Q = W^T W and wbar = W^T 1.
        M = lk.m_matrix(sv.Hq, Hx, Z, gq, gs, ybar, self.num_classes, lk.sparse_gram(sv.idx, GA))
        Q_new = lk.q_update(self.Q, Hx, dH, M, lr, c)
        wbar_new = c * self.wbar - lr * (Hx.T @ (2.0 * gq * sv.s + self.num_classes * gs + ybar))
        parts = [U_new, omega_new, HUinv_new, Q_new, wbar_new] + ([Uinv_new] if Uinv_new is not None else [])
        ok = torch.isfinite(sum(t.sum() for t in parts))  # NaN and inf survive a sum
        if info is not None:
            ok &= (info == 0).all()
        return {"U": U_new, "Uinv": Uinv_new, "omega": omega_new, "Q": Q_new, "wbar": wbar_new,
                "HUinv": HUinv_new, "fold": fold, "cond_step": cond_step, "ok": ok, "lr": lr}

    @staticmethod
    def _rho_bounds(Hx: Tensor, G: Tensor | None, kappa: Tensor) -> tuple[Tensor, Tensor]:
        """Device-side upper bounds on the largest eigenvalues of H^T diag(kappa+) H and
        H^T diag(kappa-) H: the smaller of the trace and the Frobenius norm."""
        sq = Hx.pow(2).sum(1) if G is None else G.diagonal()
        out = []
        for w in (kappa.clamp(min=0), (-kappa).clamp(min=0)):
            if G is not None:
                sw = w.sqrt()
                fro = torch.linalg.matrix_norm(G * sw[:, None] * sw[None, :])
            else:
                X = w.sqrt()[:, None] * Hx
                fro = torch.linalg.matrix_norm(X.T @ X)
            out.append(torch.minimum(w @ sq, fro))
        return out[0], out[1]

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

    def _write(self, sv: _Saved, GA: Tensor, new: dict, ok: Tensor | None = None) -> None:
        """Write the step's new state. With ``ok`` (the sync-free step) every buffer keeps its
        old value where ``ok`` is false, by ``torch.where``: no host read, no branch."""
        if ok is None:
            keep = lambda fresh, old: fresh  # noqa: E731
        else:
            keep = lambda fresh, old: torch.where(ok, fresh, old)  # noqa: E731
        if new["fold"]:
            self._fold_into_v(new["U"])
            self.folds += 1
        else:
            self.U.copy_(keep(new["U"], self.U))
            if new["Uinv"] is not None:
                self.Uinv.copy_(keep(new["Uinv"], self.Uinv))
            else:
                self._uinv_fresh = False
            self.cond_bound.copy_(keep(self.cond_bound * new["cond_step"], self.cond_bound))
        lk.scatter_add_rows_(self.V, self._local_idx(sv.idx), keep(GA, 0.0), keep(new["HUinv"], 0.0), -new["lr"])
        self.omega.copy_(keep(new["omega"], self.omega))
        self.Q.copy_(keep(0.5 * (new["Q"] + new["Q"].T), self.Q))
        self.wbar.copy_(keep(new["wbar"], self.wbar))
        self._version += 1

    def _commit(self, sv: _Saved, GA: Tensor, new: dict) -> None:
        self._write(sv, GA, new)
        self.steps += 1
        n = int(self.steps)
        self._synced = (n, int(self.skipped_nonfinite))
        self._maintain(n - 1, n)

    def _deferred_update(self, sv: _Saved, gq, gs, GA, ybar, Z, dH, finite: Tensor) -> Tensor:
        """The step with no host synchronisation: a failed step is masked out on the device
        (every buffer keeps its value) and counted; the flags are read every ``sync_every`` steps."""
        new = self._new_state(sv, gq, gs, GA, ybar, Z, dH)
        ok = new["ok"] & finite & sv.input_ok
        self._write(sv, GA, new, ok)
        self.steps += ok
        self.skipped_nonfinite += ~ok
        if not _capturing():  # a captured step is counted by its replays
            self._count_step()
        return torch.where(ok, dH, 0.0)

    def _count_step(self) -> None:
        self._calls += 1
        if self._calls % self.sync_every == 0:
            self.sync()

    def _lr_device(self) -> Tensor:
        """lr as a device scalar, refilled (outside any graph capture) when lr changed."""
        if self._lr_filled != self.lr and not _capturing():
            self._lr_t.fill_(self.lr)
            self._lr_filled = self.lr
        return self._lr_t

    @torch.no_grad()
    def train_step(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Forward, backward and update in one call, without autograd: the loss and dL/dH
        (what ``head(H, idx).backward()`` gives H). With ``sync_every > 1`` it reads
        nothing on the host: the unit that ``CudaGraphStep`` captures."""
        Hx, idx, T = self._prepare_everywhere(H, target_idx, target_val, step=True)
        self.check_decay()
        Hx, idx, T, rows = self._collect(Hx, idx, T, training=True)
        loss, saved = self._forward_step(Hx, idx, T)
        self._version += 1  # a pending autograd backward from an earlier forward is now stale
        dH = self._own_rows(self._backward_step(saved, loss.new_ones(())), rows)
        return loss, dH[:, : self.hidden_dim].to(H.dtype)

    @torch.no_grad()
    def sync(self) -> None:
        """Read the step's device flags (one host synchronisation): warn about skipped steps,
        run the repairs that fell due, and raise if a batch since the last read had bad targets."""
        if not self.deferred_checks:
            return
        steps, skipped, bad = torch.stack([self.steps, self.skipped_nonfinite, self._bad_input.long()]).tolist()
        (n_prev, skipped_prev), self._synced = self._synced, (steps, skipped)
        if any(k & (k - 1) == 0 for k in range(skipped_prev + 1, skipped + 1)):
            warnings.warn(f"{type(self).__name__}: {skipped - skipped_prev} step(s) with non-finite or invalid "
                          f"values since the last check were skipped, the head's state left untouched "
                          f"({skipped} skipped so far)", RuntimeWarning, stacklevel=2)
        self._maintain(n_prev, steps)
        if bad:
            self._bad_input.zero_()
            raise ValueError(f"a batch since the last check (at most {self.sync_every} steps) had target ids "
                             f"outside [0, {self.num_classes}) (class ids or -1 for padding); that step was "
                             "skipped and left the head's state untouched")

    # -- stabilisation ----------------------------------------------------------------------
    def _maintain(self, n_prev: int, n: int) -> None:
        """The repairs that fell due between step n_prev and step n."""
        def due(every: int) -> bool:
            return bool(every) and n // every > n_prev // every
        if due(self.q_refresh_every):
            self.refresh_bookkeeping()
            self.q_refreshes += 1
        if due(self.check_every) or float(self.cond_bound) > self.cond_trigger:
            self.stabilise()
        elif due(self.uinv_refresh_every) and self._uinv_fresh:
            self._refresh_uinv()  # Woodbury updates drift (a stale U^-1 is refreshed when next needed)
        if due(self.checksum_every):
            self.check_replicas()

    @torch.no_grad()
    def _refresh_uinv(self) -> None:
        self.Uinv.copy_(torch.linalg.inv(self.U))
        self._uinv_fresh = True
        self.uinv_refreshes += 1

    @torch.no_grad()
    def _fold_into_v(self, U: Tensor) -> None:
        """V <- V U, U = U^-1 = I: W unchanged, O(D d^2)."""
        for a in range(0, self.V.shape[0], _CHUNK):
            self.V[a:a + _CHUNK] = self.V[a:a + _CHUNK] @ U
        eye = torch.eye(self.width, dtype=self.dtype, device=self.device)
        self.U.copy_(eye)
        self.Uinv.copy_(eye)
        self._uinv_fresh = True
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
        for a in range(0, self.V.shape[0], _CHUNK):
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
        """O[:, start:end] = (H U^T) V[start:end]^T + H omega: O(m (end - start) d).
        A sharded head scores only its own classes (start:end within row_lo:row_hi)."""
        Hx, _, _ = self._prepare_everywhere(hidden, None, None)
        end = self.num_classes if end is None else end
        if self.sharded and not self.row_lo <= start <= end <= self.row_hi:
            raise ValueError(f"this shard holds classes {self.row_lo}:{self.row_hi}, not {start}:{end}")
        rows = self.V[start - self.row_lo:end - self.row_lo]
        return torch.addmm((Hx @ self.omega)[:, None], Hx @ self.U.T, rows.T)

    def score_chunks(self, hidden: Tensor, chunk_size: int = 65536):
        """Scores in chunks of classes (a sharded head: of its own classes only)."""
        if not self.sharded:
            yield from super().score_chunks(hidden, chunk_size)
            return
        Hx, _, _ = self._prepare_everywhere(hidden, None, None)
        yield from self._shard_scores(Hx, chunk_size)

    def _gather_eval(self, hidden: Tensor, target_idx: Tensor | None):
        """Checked inputs; a sharded head evaluates all ranks' rows together (each rank
        scores its own classes) and returns this rank's rows in them."""
        Hx, idx, _ = self._prepare_everywhere(hidden, target_idx, None)
        if not self.sharded or self._pg.world == 1:
            return Hx, idx, None
        if idx is None:
            (Hx,), rows = self._pg.gather_rows([Hx], [0.0])
        else:
            (Hx, idx), rows = self._pg.gather_rows([Hx, idx], [0.0, -1])
        return Hx, idx, rows

    def _shard_scores(self, Hx: Tensor, chunk_size: int):
        Ht, ht = Hx @ self.U.T, (Hx @ self.omega)[:, None]
        for a in range(0, max(self.V.shape[0], 1), chunk_size):  # an empty shard: one empty chunk
            yield self.row_lo + a, torch.addmm(ht, Ht, self.V[a:a + chunk_size].T)

    @torch.no_grad()
    def target_rank(self, hidden: Tensor, target_idx: Tensor, chunk_size: int = 65536) -> Tensor:
        if not self.sharded:
            return super().target_rank(hidden, target_idx, chunk_size)
        Hx, tidx, rows = self._gather_eval(hidden, target_idx.reshape(-1))
        tidx = tidx[:, 0]  # padding (-1) rows get a rank too: callers drop them
        # The target's score from its owner shard (0 elsewhere), then the counts of every shard.
        target = self._pg.all_reduce_(target_scores_of_chunks(self._shard_scores(Hx, chunk_size), tidx))
        count = self._pg.all_reduce_(count_at_or_above(self._shard_scores(Hx, chunk_size), tidx, target))
        return (1 + count) if rows is None else (1 + count)[rows]

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """The k best classes of each row: (scores, class ids), (m, k) each, best first.
        A sharded head merges every shard's own top k."""
        if not self.sharded:
            return super().topk(hidden, k, chunk_size)
        Hx, _, rows = self._gather_eval(hidden, None)
        best, ids = topk_of_chunks(self._shard_scores(Hx, chunk_size), k)
        k_local = best.shape[1]
        if self._pg.world > 1:
            k_all = self._pg.all_gather_ints([k_local], self.device)[:, 0]
            pad = int(k_all.max())
            best = torch.cat([best, best.new_full((best.shape[0], pad - k_local), -math.inf)], 1)
            ids = torch.cat([ids, ids.new_full((ids.shape[0], pad - k_local), -1)], 1)
            (best, ids), _ = self._pg.gather_rows([best.T.contiguous(), ids.T.contiguous()], [0.0, 0])
            best, pos = best.T.topk(min(k, self.num_classes), dim=1)  # shard blocks side by side
            ids = ids.T.gather(1, pos)
            best, ids = best[rows], ids[rows]
        return best[:, :k], ids[:, :k]

    @torch.no_grad()
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """log p(target) in O(d^2) per example (spherical and Taylor softmax)."""
        Hx, idx, rows = self._gather_eval(hidden, target_idx)
        q, s, A, *_ = self._outputs(Hx, idx)
        logp = self.loss_fn.log_prob(q, s, A, num_classes=self.num_classes).masked_fill(idx < 0, 0.0)
        logp = logp if rows is None else logp[rows]
        return logp[:, 0] if target_idx.dim() == 1 else logp

    def stats(self) -> dict[str, float]:
        """Counters of every repair and the conditioning of U, for logging."""
        names = ("steps", "skipped_nonfinite", "checks", "sv_fixes", "unfactorizations", "folds",
                 "uinv_refreshes", "q_refreshes", "eig_checks")
        out: dict[str, float] = {n: int(getattr(self, n)) for n in names}
        out["cond_estimate"] = float(self.cond_estimate)
        out["cond_bound"] = float(self.cond_bound)
        return out
