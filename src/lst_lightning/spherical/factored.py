"""The exact factored spherical head (Vincent, de Brebisson & Bouthillier).

The D x d output matrix is kept as ``W = V U + 1 omega^T`` and never formed.
Each minibatch costs O(m d^2 + m K d): the loss reads W only through
``Q = W^T W``, ``wbar = W^T 1`` and the K target rows of V, and the exact SGD
step ``W <- (1 - lr wd) W - lr dO^T H`` becomes a d x d update of U plus a
sparse update of the target rows of V. The derivation, with this file's names
(row layout: H is m x d), is docs/algorithm.md.

This file holds the step, read top to bottom (forward, backward, the exact update,
the checks, the repairs). The head is made of parts it holds and calls: its buffers
as ``state.py`` declares them, ``self.checker`` (how the step checks itself: at once on
the host, or device flags read every ``sync_every`` steps; ``sync_free.py``),
``self.repairs`` (``stabiliser.py``) and ``self.sharding`` (the process-group work;
``multi_process.py``). Sharded evaluation is a mixin (``sharded_eval.py``): it
overrides the interface's chunked evaluation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

import lst_kernels as lk

from .applied_step import AppliedStep
from .base import SphericalHeadBase, own_precision
from .blocks import row_blocks
from .graph_step import CudaGraphStep
from .collectives import ProcessGroup, bit_hash
from .multi_process import sharding_for
from .shard_files import load_rows
from .sharded_eval import ShardedEvaluation
from .stabiliser import REPAIR_COUNTERS, Repairs, Stabiliser, fell_due
from .state import REPLICATED_STATE, STATE
from .step_mode import STEP_MODES, StepMode
from .sync_free import checks_for


@dataclass
class _Saved:
    """What the forward computed that the backward and the update reuse."""
    Hx: Tensor
    idx: Tensor
    Hq: Tensor      # H Q
    Ht: Tensor      # H U^T
    HUinv: Tensor   # H U^-1 (Woodbury steps), else None
    ht: Tensor      # H omega
    s: Tensor       # rowsum of the output
    gq: Tensor
    gs: Tensor
    GA: Tensor
    input_ok: Tensor | bool = True  # DeviceFlags: a device flag, False when the batch had bad target ids


@dataclass
class _Update:
    """Everything one step changes, computed aside so a failure leaves the head untouched."""
    GA: Tensor               # dL/dA, scaled by the upstream gradient
    U: Tensor
    Uinv: Tensor | None      # None: U^-1 is left stale (the step solved with U instead)
    omega: Tensor
    Q: Tensor
    wbar: Tensor
    HUinv: Tensor            # H U_new^-1: the rows scattered into V
    fold: bool               # a nearly singular step: U B is folded into V
    ok: Tensor               # device bool: all of it finite, every solve regular
    # The checker's scalars (sync_free.py): floats under HostChecks, device tensors under
    # DeviceFlags, which never reads them on the host.
    cond_step: Tensor | float  # bound on cond(B): the carried bound on cond(U) grows by it
    lr: Tensor | float


class FactoredSphericalHead(ShardedEvaluation, SphericalHeadBase):
    """Exact O(m d^2) training of a D-class output layer with a spherical loss.

    ``stabiliser``: the settings of the exact repairs (a ``Stabiliser`` or a dict of its
    fields). ``parallel`` ("none", "replicated", "sharded") and ``checksum_every``:
    multi-process training. ``sync_every > 1``: a training step that reads nothing on
    the host. ``step``: "autograd" (the update inside ``loss.backward()``), "fused"
    (forward, backward and update in the forward; backward only hands dL/dH on) or
    "cuda_graph" (that fused step replayed from a CUDA graph; needs ``sync_every > 1``).
    ``stats()`` returns the counters of each repair and the condition estimate.
    """

    step_modes = STEP_MODES
    parallel_modes = ("replicated", "sharded")

    def __init__(self, num_classes: int, hidden_dim: int, *args, init_std: float | None = None,
                 generator: torch.Generator | None = None, stabiliser: Stabiliser | dict | None = None,
                 parallel: str = "none", checksum_every: int = 100, sync_every: int = 1,
                 step: str = "autograd", **kwargs):
        super().__init__(num_classes, hidden_dim, *args, init_std=init_std, generator=generator, **kwargs)
        #: the repairs, with their settings (stabiliser.py)
        self.repairs = Repairs(Stabiliser.of(stabiliser))
        #: step, sync_every and parallel, validated together once (step_mode.py).
        self.mode = StepMode(step, sync_every, parallel)
        self._graph = None  # the CUDA graph of the fused step (step="cuda_graph"), made at first use
        if not (isinstance(checksum_every, int) and checksum_every >= 0):
            raise ValueError(f"checksum_every must be an int >= 0, got {checksum_every!r}")
        self.checksum_every = checksum_every
        #: the process-group work (multi_process.py): which rows of V are here, the collectives.
        #: V's rows are drawn block by block from one seed, so that a shard can be made
        #: alone (a sharded head never holds all of V) and equals the same rows unsharded.
        self.sharding = sharding_for(parallel, num_classes)
        for buf in STATE:  # every buffer, as state.py declares it
            self.register_buffer(buf.name, buf.initial(self), persistent=buf.persistent)
        self._uinv_fresh = True  # host-side: the forward must not read a device flag
        #: how the step checks itself: HostChecks (sync_every == 1) or DeviceFlags (sync_free.py)
        self.checker = checks_for(self.mode.deferred_checks)
        if self.sharding.joined:
            self.refresh_bookkeeping()

    @property
    def device(self) -> torch.device:
        return self.V.device

    @property
    def stabiliser(self) -> Stabiliser:
        """The repairs' settings."""
        return self.repairs.settings

    @property
    def sharded(self) -> bool:
        return self.sharding.sharded

    @property
    def row_lo(self) -> int:
        """V holds the rows of classes [row_lo, row_hi): all of them unless sharded."""
        return self.sharding.lo

    @property
    def row_hi(self) -> int:
        return self.sharding.hi

    @property
    def step(self) -> str:
        return self.mode.step

    @step.setter
    def step(self, value: str) -> None:
        self.mode = dataclasses.replace(self.mode, step=value)  # validated with sync_every and parallel
        self._graph = None

    @property
    def sync_every(self) -> int:
        return self.mode.sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        self.mode = dataclasses.replace(self.mode, sync_every=value)
        self.checker = checks_for(self.mode.deferred_checks, self.checker)

    @property
    def parallel(self) -> str:
        return self.mode.parallel

    @property
    def deferred_checks(self) -> bool:
        """True with ``sync_every > 1``: the training step never waits for the device; its
        checks raise device flags that ``sync()`` reads every ``sync_every`` steps."""
        return self.checker.deferred

    @property
    def _calls(self) -> int:
        """Training steps run since the checks were made (host count; DeviceFlags)."""
        return self.checker.calls

    @property
    def _synced(self) -> tuple[int, int]:
        """(steps, skipped) at the last read of the checks."""
        return self.checker.synced

    def cannot_accumulate(self) -> str | None:
        return self.mode.cannot_accumulate()

    @property
    def uinv_fresh(self) -> bool:
        """Whether U^-1 is up to date (steps that solve with U leave it behind)."""
        return self._uinv_fresh

    def get_extra_state(self):
        return {**super().get_extra_state(), "uinv_fresh": self._uinv_fresh}

    def set_extra_state(self, state) -> None:
        super().set_extra_state(state)
        self._uinv_fresh = bool(state.get("uinv_fresh", False))  # unknown: refresh when needed
        self.checker.synced = (int(self.steps), int(self.skipped_nonfinite))  # buffers load before extra state

    # -- the implicit W -----------------------------------------------------------------
    @torch.no_grad()
    def weight(self) -> Tensor:
        """The implicit W: its rows row_lo:row_hi when sharded."""
        self._ensure_distributed()
        W = torch.empty_like(self.V)
        for a, blk in row_blocks(self.V):
            torch.addmm(self.omega, blk, self.U, out=W[a:a + blk.shape[0]])
        return W

    @torch.no_grad()
    def reset_weight(self, W: Tensor | None = None) -> None:
        """Make the implicit W equal to W: V = W, U = U^-1 = I, omega = 0, O(D d^2) bookkeeping.
        Without W: the head as constructed (initial W from its seed, counters zero), e.g.
        after ``to_empty()`` of a head built on the meta device."""
        if W is None:
            self._ensure_distributed()
            for buf in STATE:  # every buffer as constructed (state.py)
                getattr(self, buf.name).copy_(buf.initial(self, self.device))
            self.checker = checks_for(self.mode.deferred_checks)
            self._reset_factors()
            return
        if not isinstance(W, Tensor) or tuple(W.shape) != (self.num_classes, self.width):
            raise ValueError(f"W must have shape {(self.num_classes, self.width)}, got "
                             f"{tuple(W.shape) if isinstance(W, Tensor) else type(W).__name__}")
        if not torch.isfinite(W).all():
            raise ValueError("W has non-finite entries")
        self._ensure_distributed()
        self.V.copy_(W[self.row_lo:self.row_hi])
        self._reset_factors()

    def _reset_factors(self) -> None:
        """U = U^-1 = I, omega = 0, then Q and wbar from V: W = V."""
        self._uninitialised = False
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
        for _, blk in row_blocks(self.V):
            VtV.addmm_(blk.T, blk)
            v1 += blk.sum(0)
        self.sharding.all_reduce_(VtV)  # sharded: V^T V over every rank's rows
        self.sharding.all_reduce_(v1)
        U, w = self.U, self.omega
        Utv = U.T @ v1
        Q = U.T @ VtV @ U + torch.outer(Utv, w) + torch.outer(w, Utv) + self.num_classes * torch.outer(w, w)
        self.Q.copy_(0.5 * (Q + Q.T))
        self.wbar.copy_(Utv + self.num_classes * w)
        self._version += 1

    # -- one training step, top to bottom: forward, backward, exact update, checks, repairs --
    # train_step (and step="fused"/"cuda_graph") runs _fused_step; step="autograd" runs the
    # same two halves, _forward_step in forward() and _backward_step in loss.backward()
    # (base.py's _SelfUpdatingStep, pending_step.py: when the step is taken).
    @own_precision
    @torch.no_grad()
    def train_step(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Forward, backward and update in one call, without autograd: the loss and dL/dH
        (what ``head(H, idx).backward()`` gives H). With ``sync_every > 1`` it reads
        nothing on the host: the unit that ``CudaGraphStep`` captures."""
        _, idx, T = self._prepare_everywhere(H, target_idx, target_val, step=True)
        self.check_decay()
        return self._fused_step(H, idx, T)

    @torch.no_grad()
    def _fused_step(self, H: Tensor, idx: Tensor, T: Tensor) -> tuple[Tensor, Tensor]:
        """``train_step`` on checked targets."""
        Hx, idx, T, rows = self.sharding.collect(self.augment(H), idx, T, training=True)
        loss, saved = self._forward_step(Hx, idx, T)
        self._version += 1  # a pending autograd backward from an earlier forward is now stale
        dH = self.sharding.own_rows(self._backward_step(saved, loss.new_ones(())), rows)
        return loss, dH[:, : self.hidden_dim].to(H.dtype)

    def _training_loss(self, H: Tensor, idx: Tensor, T: Tensor) -> Tensor:
        if self.step == "autograd":
            return super()._training_loss(H, idx, T)
        if self.step == "cuda_graph":
            if self._graph is None:
                self._graph = CudaGraphStep(self, H.shape[0], idx.shape[1], hidden_dtype=H.dtype)
            if H.shape[0] == self._graph.m:  # another batch size runs the same step eagerly
                return AppliedStep.apply(H, *self._graph(H.detach(), idx, T))
        return AppliedStep.apply(H, *self._fused_step(H, idx, T))

    @torch.no_grad()
    def _forward_step(self, Hx, idx, T):
        """The loss and what the backward reuses: q, s, A and the products with H."""
        idx, T, input_ok = self.checker.screen(self, idx, T)  # DeviceFlags: bad ids become a flag
        woodbury = self._use_woodbury(Hx.shape[0])
        if woodbury and not self._uinv_fresh:
            self.repairs.refresh_uinv(self)  # the last steps solved with U directly and left U^-1 behind
        q, s, A, Hq, Ht, HUinv, ht = self._outputs(Hx, idx, with_uinv=woodbury)
        L, gq, gs, GA = self.loss_and_grads(q, s, A, T, self.y_sq(idx, T), idx)
        return L, _Saved(Hx, idx, Hq, Ht, HUinv, ht, s, gq, gs, GA, input_ok)

    def _use_woodbury(self, m: int) -> bool:
        # Woodbury costs m^2 d + m^3, a fresh solve with U d^3 + m d^2: measured crossover near m = d/2.
        woodbury = self.stabiliser.woodbury
        return woodbury == "always" or (woodbury == "auto" and 2 * m <= self.width)

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
        A = self.sharding.gather_dot(self.V, idx, Ht, ht) if idx is not None else None
        return q, s, A, Hq, Ht, HUinv, ht

    @torch.no_grad()
    def _backward_step(self, sv: _Saved, grad_out: Tensor) -> Tensor:
        """dL/dH, then the exact update written if its checks pass, then the repairs due."""
        Hx = sv.Hx
        checker = self.checker  # HostChecks: each verdict read at once; DeviceFlags: device flags
        dH, gq, gs, GA, ybar, Z = self._hidden_grad(sv, grad_out, parts=True)
        finite = torch.isfinite(Hx.sum() + gq.sum() + gs.sum() + GA.sum())
        ok = checker.verdict(self, True, sv.input_ok & finite, "hidden states or loss gradients")
        if ok is False:  # skipped on the host: nothing changes
            return torch.zeros_like(dH)
        update = self._new_state(sv, gq, gs, GA, ybar, Z, dH)
        ok = checker.verdict(self, ok, update.ok, "state after the step")
        if ok is False:
            return torch.zeros_like(dH)
        self._write(sv, update, ok)
        if checker.count(self, ok):  # every step (HostChecks) or every sync_every steps (DeviceFlags)
            self.sync()  # the repairs that fell due
        return checker.where(ok, dH, 0.0)

    @torch.no_grad()
    def _hidden_grad(self, sv: _Saved, grad_out: Tensor, parts: bool = False):
        """dL/dH = dO W without dO: Z = (g_s 1^T + Yd) W, plus 2 g_q H Q. Nothing changes."""
        gq, gs, GA = sv.gq * grad_out, sv.gs * grad_out, sv.GA * grad_out
        ybar = GA.sum(1)
        YV = self.sharding.gather_sum(self.V, sv.idx, GA)  # Yd V: K rows of V per example
        Z = YV @ self.U + torch.outer(ybar, self.omega) + torch.outer(gs, self.wbar)
        dH = torch.addcmul(Z, gq[:, None], sv.Hq, value=2.0)
        return (dH, gq, gs, GA, ybar, Z) if parts else dH

    def _new_state(self, sv: _Saved, gq, gs, GA, ybar, Z, dH) -> _Update:
        """The step's new state, computed aside: nothing of the head changes here."""
        Hx = sv.Hx
        lr = self.checker.lr(self)  # DeviceFlags: a device scalar (a captured graph reads it each replay)
        m = Hx.shape[0]
        c = 1.0 - lr * self.weight_decay  # > 0: forward checked lr * weight_decay < 1
        kappa = (2.0 * lr / c) * gq  # B = c (I - H^T diag(kappa) H)
        use_woodbury = sv.HUinv is not None
        G = Hx @ Hx.T if use_woodbury else None
        fold, cond_step = self.checker.step_bounds(self, Hx, G, kappa)  # fold: a nearly singular B
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
        return _Update(GA=GA, U=U_new, Uinv=Uinv_new, omega=omega_new, Q=Q_new, wbar=wbar_new, HUinv=HUinv_new,
                       fold=fold, cond_step=cond_step, ok=ok, lr=lr)

    def _write(self, sv: _Saved, new: _Update, ok: Tensor | bool = True) -> None:
        """Write the step's new state. Under DeviceFlags every buffer keeps its old value
        where the flag ``ok`` is false, by ``torch.where``: no host read, no branch."""
        keep = lambda fresh, old: self.checker.where(ok, fresh, old)  # noqa: E731
        if new.fold:
            self.repairs.fold_into_v(self, new.U)
            self.folds += 1
        else:
            self.U.copy_(keep(new.U, self.U))
            if new.Uinv is not None:
                self.Uinv.copy_(keep(new.Uinv, self.Uinv))
            else:
                self._uinv_fresh = False
            self.cond_bound.copy_(keep(self.cond_bound * new.cond_step, self.cond_bound))
        rows = self.sharding.local_idx(sv.idx)  # sharded: only this rank's rows of V
        lk.scatter_add_rows_(self.V, rows, keep(new.GA, 0.0), keep(new.HUinv, 0.0), -new.lr)
        self.omega.copy_(keep(new.omega, self.omega))
        self.Q.copy_(keep(0.5 * (new.Q + new.Q.T), self.Q))
        self.wbar.copy_(keep(new.wbar, self.wbar))
        self._version += 1

    @torch.no_grad()
    def sync(self) -> None:
        """Read the step's checks (DeviceFlags: one host synchronisation; it warns about
        skipped steps), run the repairs that fell due since the last read, and raise if a
        batch since then had bad targets. Nothing to read: nothing happens."""
        read = self.checker.read(self)
        if read is None:
            return
        n_prev, n, bad_input = read
        self.repairs.run_due(self, n_prev, n)
        if fell_due(self.checksum_every, n_prev, n):
            self.check_replicas()
        if bad_input:
            self.checker.raise_bad_input(self)

    @torch.no_grad()
    def stabilise(self) -> None:
        """Recompute U^-1, then bring U's singular values into [sv_min, sv_max] (exact, W unchanged)."""
        self.repairs.stabilise(self)

    # -- exact accumulation: one step on the rows of several backward passes (pending_step.py)
    def _pending_record(self, sv: _Saved, weight: Tensor):
        return sv.Hx, sv.idx, sv.gq * weight, sv.gs * weight, sv.GA * weight

    @torch.no_grad()
    def _apply_records(self, records: list) -> None:
        """The step on the union of the micro-batches: their rows, targets padded to one K."""
        K = max(r[1].shape[1] for r in records)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, K - t.shape[1]), value=v)  # noqa: E731
        Hx = torch.cat([r[0] for r in records])
        idx = torch.cat([pad(r[1], -1) for r in records])
        gq, gs = torch.cat([r[2] for r in records]), torch.cat([r[3] for r in records])
        GA = torch.cat([pad(r[4], 0.0) for r in records])
        woodbury = self._use_woodbury(Hx.shape[0])
        if woodbury and not self._uinv_fresh:
            self.repairs.refresh_uinv(self)
        _, s, _, Hq, Ht, HUinv, ht = self._outputs(Hx, None, with_uinv=woodbury)
        self._backward_step(_Saved(Hx, idx, Hq, Ht, HUinv, ht, s, gq, gs, GA), gq.new_ones(()))

    # -- more than one process (head.sharding: multi_process.py; docs/multi_gpu.md) -----
    @torch.no_grad()
    def distribute(self, process_group=None) -> None:
        """Join the ranks of ``process_group`` (default: the whole world; alone when
        torch.distributed is not initialised). Every rank must call it: rank 0's state
        is taken by all (its V rows, for a shard); a sharded head makes its own rows."""
        if self.parallel == "none":
            return
        pg, old = ProcessGroup.current(process_group), self.sharding
        if old.joined and (pg.rank, pg.world) == (old.pg.rank, old.pg.world):
            return
        if old.joined and self.sharded and old.world > 1:
            raise RuntimeError("a sharded head cannot be re-distributed over another group")
        new, dev = old.joined_to(pg), self.device
        for name in REPLICATED_STATE:
            pg.broadcast_(getattr(self, name))
        self._init_seed = int(pg.all_gather_ints([self._init_seed], dev)[0, 0])
        same_v = False
        if self.V.shape[0] == self.num_classes:
            h = bit_hash([self.V])
            same_v = bool((pg.all_gather_ints([h], dev) == h).all())
        if not self.sharded:
            if not same_v:
                pg.broadcast_(self.V)
        elif same_v:
            self.V = self.V[new.lo:new.hi].clone()
        elif self.V.shape[0] == 0 and not int(self.steps):
            self.V = self._init_rows(new.lo, new.hi, dev)
        else:
            raise RuntimeError("the ranks hold different V: distribute() a sharded head before training it")
        self.sharding = new
        self.refresh_bookkeeping()  # also bumps the version: no stale backward survives this

    @torch.no_grad()
    def gather_v(self, dst: int = 0) -> Tensor | None:
        """All of V on rank ``dst`` (on the host), None on the other ranks; every rank must
        call it. A checkpoint holding it loads into a head sharded over any number of ranks."""
        return self.sharding.gather_v(self.V, dst)

    def state_hash(self) -> int:
        """A hash of the bits of the state every rank must hold alike (V too unless sharded)."""
        return bit_hash([getattr(self, n) for n in self.sharding.hashed_state()])

    def check_replicas(self) -> None:
        """Raise on every rank when the ranks' shared state differs in any bit."""
        self.sharding.check_replicas(self)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        V = state_dict.get(prefix + "V")
        files = (state_dict.get(prefix + "_extra_state") or {}).get("v_files")
        if V is not None and (files is not None or (self.sharded and V.shape[0] == self.num_classes != self.V.shape[0])):
            self._ensure_distributed()
            # A whole V (from gather_v), or one file per rank (shard_files): keep this rank's rows.
            mine = load_rows(files, self.row_lo, self.row_hi) if files is not None else V[self.row_lo:self.row_hi]
            state_dict = {**state_dict, prefix + "V": mine}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def _eval_loss(self, Hx, idx, T):
        Hx, idx, T, rows = self.sharding.collect(Hx, idx, T, training=False)
        q, s, A, *_ = self._outputs(Hx, idx)
        per_example = self.loss_fn(q, s, A, T, num_classes=self.num_classes, y_sq=self.y_sq(idx, T))
        return self.reduce(per_example, idx) if rows is None else self.reduce(per_example[rows], idx[rows])

    @own_precision
    @torch.no_grad()
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """The loss's score (``loss_fn.score``: the model's own ranking) of the outputs
        O[:, start:end] = (H U^T) V[start:end]^T + H omega: O(m (end - start) d).
        A sharded head scores only its own classes (start:end within row_lo:row_hi)."""
        Hx, _, _ = self._prepare_everywhere(hidden, None, None)
        end = self.num_classes if end is None else end
        if self.sharded and not self.row_lo <= start <= end <= self.row_hi:
            raise ValueError(f"this shard holds classes {self.row_lo}:{self.row_hi}, not {start}:{end}")
        rows = self.V[start - self.row_lo:end - self.row_lo]
        return self.loss_fn.score(torch.addmm((Hx @ self.omega)[:, None], Hx @ self.U.T, rows.T))

    @own_precision
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
        out: dict[str, float] = {n: int(getattr(self, n)) for n in ("steps", "skipped_nonfinite", *REPAIR_COUNTERS)}
        out["cond_estimate"] = float(self.cond_estimate)
        out["cond_bound"] = float(self.cond_bound)
        return out
