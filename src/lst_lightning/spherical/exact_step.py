"""The exact step of the factored head, in docs/algorithm.md's order: forward (q, s, A; the loss
and its gradients), backward (dL/dH), the new state computed aside, its checks, the write.

The step is functions of the plan (plan.py's ``StepPlan``: every mode settled, the loss, the
collectives), the state (state.py's ``StepState``: the head's buffers, gathered) and the batch;
none of them takes the head. ``device_step(plan, state, batch, lr, draws)`` is the whole step
under device flags (``sync_every > 1``): every check a flag masking the write, nothing read on the
host, the one unit driver.py compiles whole and a CUDA graph replays; the autograd step runs
its halves (``forward``, ``update``) and exact accumulation ``records_step``.

The host's part of a step, the only code that takes the head, is driver.py: the version, U^-1
refreshed where due, the lr and the draw's uniforms before the device part, the flags ticked and read
and the repairs that fell due after it; and the step with host checks (``sync_every == 1``), which
reads each check as it is made, around this file's ``hidden_grad``, ``new_state`` and ``write``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

import lst_kernels as lk

from .inverse_update import neumann_factors, residual_tolerance, uinv_by_products
from .state import StepState


class Batch(NamedTuple):
    """A training batch as the step takes it: H augmented, target ids (-1: padding), their values,
    the real rows the "mean" reduction divides by, a device count (None: idx's rows), and the
    fixed-size exchange the ranks' rows came through (padded_rows.py; None: not exchanged)."""
    Hx: Tensor
    idx: Tensor
    T: Tensor
    rows: Tensor | None = None
    exchange: object = None


class Flags(NamedTuple):
    """What a device step leaves for the host to read: ``ok`` (a device bool: the write was taken),
    ``fold`` (the step folded into V), and with the kernel proposal the classes whose rows of V the
    write moved (``written``; its sum-tree follows them), else None."""
    ok: Tensor
    fold: Tensor | bool
    written: Tensor | None = None


@dataclass
class SavedForward:
    """What the forward computed that the backward and the update reuse."""
    Hx: Tensor
    idx: Tensor
    Hq: Tensor      # H Q
    HUt: Tensor      # H U^T
    HUinv: Tensor   # H U^-1 (Woodbury steps), else None
    ht: Tensor      # H omega
    s: Tensor       # rowsum of the output
    gq: Tensor
    gs: Tensor
    GA: Tensor
    input_ok: Tensor | bool = True  # device flags: False when the batch had bad target ids
    neg: object = None  # sampled classes (negatives.py): a SharedBlock or PerRowSlots; None when off
    real: Tensor | None = None  # the rows with a target (the preconditioner's moments count these only)
    kept: int | None = None  # padded to a batch size (batch_shapes.py): the batch's own rows; None: not padded


@dataclass
class NewState:
    """Everything one step changes, computed aside so a failure leaves the head untouched."""
    GA: Tensor               # dL/dA, scaled by the upstream gradient
    U: Tensor
    Uinv: Tensor | None      # None: U^-1 is left stale (the step solved with U instead)
    omega: Tensor
    Q: Tensor
    wbar: Tensor
    HUinv: Tensor            # H U_new^-1: the rows scattered into V
    fold: bool | Tensor      # a nearly singular step: U B is folded into V (device flags: a device bool)
    ok: Tensor               # device bool: all of it finite, every solve regular
    # floats when the checks are read on the host; device tensors under device flags
    cond_step: Tensor | float  # bound on cond(B): the carried bound on cond(U) grows by it
    lr: Tensor | float
    moments: object = None   # the preconditioner's new moments (preconditioner.Moments); None when off
    order: lk.SortedIds | None = None  # the step's ids sorted once (the gram_rows route), for the write's scatter
    right: Tensor | None = None  # R with H U_new^-1 = H R (R = P U_new^-1, the products route); else None
    rho: Tensor | None = None  # device flags, adaptive Neumann rule: the bound on A's spectral radius
    eig: tuple[int, int] = (0, 0)  # host checks: (eigenvalue computations, their failures) of this step


#: eager on the CPU, a device flag is read where it is made (``cpu_flag``); False: masked by
#: ``torch.where`` as on a GPU (tests compare the two)
READ_CPU_FLAGS = True


def cpu_flag(plan, flag: Tensor) -> Tensor | bool:
    """``flag`` (a device bool) as a Python bool where reading it costs nothing: the eager step on
    the CPU, where nothing waits (a compiled graph takes no host read); else the tensor itself,
    which masks the write by ``torch.where``. The same bits either way."""
    if READ_CPU_FLAGS and flag.device.type == "cpu" and not plan.compiled and not torch.compiler.is_compiling():
        return bool(flag)
    return flag


# -- the loss on m-sized tensors --------------------------------------------------------------
def y_sq(idx: Tensor, T: Tensor) -> Tensor:
    """||y||^2 per row, with repeated classes in a row summed first (the squared error)."""
    same = (idx[:, :, None] == idx[:, None, :]) & (idx[:, :, None] >= 0)
    return (T[:, :, None] * T[:, None, :] * same).sum((1, 2))


def row_weights(reduction: str, idx: Tensor, dtype: torch.dtype, rows: Tensor | None = None) -> Tensor:
    """d reduce(per, idx) / d per (m,): 1/n on the rows with a real slot (n as ``reduction``
    says; 1 for "sum"), 0 on a fully padded row. ``rows``: the batch's rows that "mean"
    divides by, a device count (the ranks' rows of a gathered batch padded to their
    capacity: ``processes.rows``); None: idx's rows."""
    real = (idx >= 0).any(1)
    if reduction == "sum":
        return real.to(dtype)
    if reduction == "mean_real":
        n = real.sum().clamp_min(1)
    else:
        n = idx.shape[0] if rows is None else rows
    return real.to(dtype) / n


def reduce(per_example: Tensor, weight: Tensor) -> Tensor:
    """The minibatch loss from per-example losses, ``sum_i weight_i l_i`` (``row_weights``); a fully
    padded row (every slot -1) contributes nothing, whatever its loss, for every loss (the squared
    error would see a zero target)."""
    return (torch.where(weight != 0, per_example, torch.zeros((), dtype=weight.dtype, device=weight.device))
            * weight).sum()


# -- forward ---------------------------------------------------------------------------------
def outputs(plan, state, Hx: Tensor, idx: Tensor | None, with_uinv: bool = False):
    """q, s, the target outputs A and the products reused by backward."""
    d = plan.width
    mats = [state.Q, state.U.T] + ([state.Uinv] if with_uinv else [])
    P = Hx @ torch.cat(mats, dim=1)  # one GEMM for H Q, H U^T (and H U^-1)
    Hq, HUt = P[:, :d], P[:, d:2 * d]
    HUinv = P[:, 2 * d:] if with_uinv else None
    q = (Hx * Hq).sum(1)
    s = Hx @ state.wbar
    ht = Hx @ state.omega
    A = None
    if idx is not None:
        sh = plan.collectives
        A = lk.gather_dot(state.V, idx, HUt, ht) if plan.processes == "none" else sh.gather_dot(state.V, idx, HUt, ht)
    return q, s, A, Hq, HUt, HUinv, ht


def inverse_route(plan, m: int) -> str:
    """How a step of m rows makes H U_new^-1, as its plan says: "woodbury", "solve" or "products"."""
    return "woodbury" if m <= plan.woodbury_rows else plan.inverse


def screen(plan, state, idx: Tensor, T: Tensor, padded=None):
    """Device flags: bad ids become padding and the step is void (``input_ok`` False); the first
    such step since the last read is recorded (``state.bad_input``: its number, from 1). Several
    processes: the ranks' rows exchanged padded to their capacity (``padded``: padded_rows.py), a
    rank that sent none voids the step too, and the first void step's rank is recorded."""
    bad = (idx < -1) | (idx >= plan.num_classes)
    input_ok = ~bad.any()
    if padded is None and cpu_flag(plan, input_ok) is True:  # read on the CPU: nothing to mask
        return idx, T, input_ok
    if padded is not None:
        input_ok = input_ok & padded.ranks_ok()
    first = (state.bad_input == 0) & ~input_ok
    state.bad_input.copy_(torch.where(first, state.steps + state.skipped_nonfinite + 1, state.bad_input))
    if padded is not None:
        padded.note_fault(first, bad)
    return torch.where(bad, -1, idx), torch.where(bad, 0.0, T), input_ok


@torch.no_grad()
def forward(plan, state, batch: Batch, draws: Tensor | None = None) -> tuple[Tensor, SavedForward]:
    """The loss and what the backward reuses: q, s, A, the loss gradients and the products with H.
    ``draws``: the host's uniforms of the sampled classes (``before_step``; None: the kernel
    proposal, which draws here from its tree)."""
    Hx, idx, T, rows, exchange = batch
    input_ok = True
    if plan.deferred:
        idx, T, input_ok = screen(plan, state, idx, T, exchange)  # bad ids become padding and a device flag
    route = inverse_route(plan, Hx.shape[0])
    q, s, A, Hq, HUt, HUinv, ht = outputs(plan, state, Hx, idx, with_uinv=route == "woodbury")
    real = None if plan.preconditioner is None else (idx >= 0).any(1)  # the rows P's moments count
    # the minibatch loss and its gradients dL/dq (m), dL/ds (m), dL/dA (m, K): in closed form
    # where the loss has one (Loss.grads; autograd on these m-sized tensors otherwise)
    loss_fn = plan.loss
    y2 = y_sq(idx, T) if loss_fn.needs_y_sq else None  # (with sampled classes: the spherical term's)
    weight = row_weights(plan.reduction, idx, q.dtype, rows)
    neg = None
    if plan.negatives is None:
        per, gq, gs, GA = loss_fn.grads(q, s, A, T, weight, num_classes=plan.num_classes, y_sq=y2)
    else:  # sampled classes as slots (negatives.py); never entered when off
        per, gq, gs, GA, idx, neg = plan.sampling.loss_and_grads(plan, state, q, s, A, idx, T, HUt, ht, draws,
                                                                 weight, y2)
    L = reduce(per, weight)
    return L, SavedForward(Hx, idx, Hq, HUt, HUinv, ht, s, gq, gs, GA, input_ok, neg, real)


# -- backward ------------------------------------------------------------------------------------
@torch.no_grad()
def hidden_grad(plan, state, fwd: SavedForward, grad: Tensor | None, parts: bool = False):
    """dL/dH = dO W without dO: Z = (g_s 1^T + Yd) W, plus 2 g_q H Q. Nothing changes. ``grad``: the
    upstream gradient (None: 1, the fused step's)."""
    gq, gs, GA = (fwd.gq, fwd.gs, fwd.GA) if grad is None else (fwd.gq * grad, fwd.gs * grad, fwd.GA * grad)
    ybar = GA.sum(1)
    sh = plan.collectives
    YV = lk.gather_sum(state.V, fwd.idx, GA) if plan.processes == "none" else sh.gather_sum(state.V, fwd.idx, GA)
    if fwd.neg is not None and fwd.neg.shared:  # shared negatives: one dense block (negatives.py)
        YV, ybar = fwd.neg.hidden(grad, YV, ybar)
    Z = YV @ state.U + torch.outer(ybar, state.omega) + torch.outer(gs, state.wbar)
    dH = torch.addcmul(Z, gq[:, None], fwd.Hq, value=2.0)
    return (dH, gq, gs, GA, ybar, Z) if parts else dH


def eig_bounds(A: Tensor, sq: Tensor, kappa: Tensor) -> tuple[Tensor, Tensor]:
    """Device scalars (rho_pos, rho_neg), both >= 0, with every eigenvalue of A in [-rho_neg, rho_pos].

    A is ``H^T diag(kappa) H P`` (d x d) or ``diag(kappa) H P H^T`` (m x m: the same nonzero
    eigenvalues), P symmetric positive definite (I without a preconditioner): similar to the
    symmetric ``L^T H^T diag(kappa) H L`` (P = L L^T), so its eigenvalues are real. They lie
    - below the trace of its positive part and above minus that of its negative part:
      ``sum(kappa+ h^T P h)``, ``sum(kappa- h^T P h)`` with ``sq`` (m,) h^T P h or a bound on it
      (O(m d));
    - within ``sqrt((n - 1) / n * tr(C^2))`` of their mean ``mu = tr(A) / n``, ``C = A - mu I``
      (n x n), ``tr(C^2) = sum(C * C^T)``: the sum of the squared deviations (O(n^2)), the
      largest of which is at most (n - 1) / n of it since the deviations sum to 0 (Wolkowicz and
      Styan's bound; at most the Frobenius norm of the symmetric matrix similar to A).
    Each bound is the smaller of the two. No host read."""
    n = A.shape[0]
    mu = A.diagonal().sum() / n
    C = A - mu * torch.eye(n, dtype=A.dtype, device=A.device)
    spread = (((n - 1) / n) * (C * C.T).sum()).clamp(min=0).sqrt()
    trace_pos, trace_neg = kappa.clamp(min=0) @ sq, (-kappa).clamp(min=0) @ sq
    return (torch.minimum(trace_pos, (mu + spread).clamp(min=0)),
            torch.minimum(trace_neg, (spread - mu).clamp(min=0)))


def fold_and_cond(plan, A: Tensor, sq: Tensor, kappa: Tensor) -> tuple[bool, float | None, float, tuple[int, int]]:
    """Read on the host: whether to fold this step into V (min |eig(B/c)| < fold_tol), a
    bound on cond(B), one on the spectral radius of A (the products route's rho), for
    B = c (I - A) and A as ``eig_bounds`` takes it, and (eigenvalue computations, their failures)
    for the head's counters (``eig_checks``, ``eig_failures``: this function changes nothing).
    The eigenvalues of A are computed only when the cheap bounds cannot rule out one of B/c below
    1/2 (O(n^3): large steps only). When that eigenvalue computation fails (or returns non-finite
    values) the bound is None: the step is skipped, counted in ``eig_failures`` and
    ``skipped_nonfinite``, never raised."""
    rho_pos, rho_neg = torch.stack(eig_bounds(A, sq, kappa)).tolist()  # one host read
    rho = max(rho_pos, rho_neg)
    if rho_pos <= 0.5:
        return False, (1.0 + rho_neg) / (1.0 - rho_pos), rho, (0, 0)
    if not math.isfinite(rho_pos) or not bool(torch.isfinite(A).all()):
        # an overflowed step (huge H or loss gradients): no eigenvalues to take (LAPACK
        # would raise); the step's own finiteness check skips it and counts it
        return False, math.inf, math.inf, (0, 0)
    try:  # A's eigenvalues are real (eig_bounds); the m x m form lacks the 1s of B/c on A's null space
        ev = torch.linalg.eigvals(A).real
        ev = torch.cat([ev, ev.new_zeros(1)]) if A.shape[0] < plan.width else ev
    except RuntimeError:  # torch.linalg.LinAlgError (LAPACK did not converge on a finite but
        # ill-conditioned A) among others: the step is skipped and counted, never raised
        return False, None, math.inf, (1, 1)
    if not bool(torch.isfinite(ev).all()):
        return False, None, math.inf, (1, 1)
    lam = (1.0 - ev).abs()
    lo, hi = float(lam.min()), float(lam.max())
    return lo < plan.fold_tol, (hi / lo if lo > 0 else math.inf), float(ev.abs().max()), (1, 0)


def device_bounds(plan, cond_bound: Tensor, A: Tensor, sq: Tensor, kappa: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Device flags: (fold, a bound on cond(B), the bound on A's spectral radius the adaptive Neumann
    rule keeps or None) as device tensors, from the bounds of B = c (I - A) (``eig_bounds``), with no
    host read: the step is folded into V where the bounds cannot rule out an eigenvalue of B/c within
    ``fold_tol`` of 0, or where cond(U)'s bound would pass ``fold_cond`` (docs/factored_head.md,
    "Nearly singular steps")."""
    rho_pos, rho_neg = eig_bounds(A, sq, kappa)
    rho = torch.maximum(rho_pos, rho_neg) if plan.neumann == "adaptive" else None
    cond_step = torch.where(rho_pos < 1, (1 + rho_neg) / (1 - rho_pos).clamp_min(1e-30), math.inf)
    fold = (rho_pos > 1 - plan.fold_tol) | (cond_bound * cond_step > plan.fold_cond)
    return fold, cond_step, rho


def solve_right(U: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """(X U^-1, LAPACK's info: > 0 where U is singular), as ``torch.linalg.solve_ex(U, X,
    left=False)`` but by its LU and two triangular solves from the right, in the column order
    of the pivots: 0.46 against 0.55 ms at m = 256, d = 129 on one CPU thread."""
    LU, pivots, info = torch.linalg.lu_factor_ex(U)  # U = P L R
    Y = torch.linalg.solve_triangular(LU, X, upper=True, left=False)  # (X P L) R = X U
    Y = torch.linalg.solve_triangular(LU, Y, upper=False, unitriangular=True, left=False)  # X P
    P = torch.lu_unpack(LU, pivots, unpack_data=False)[0]
    return Y.index_select(1, P.argmax(1)), info  # X = (X P) P^T


# -- the U^-1 routes: H U_new^-1 by Woodbury, by products of U^-1 or by a solve (solve_right) -----
def by_woodbury(state, fwd: SavedForward, X: Tensor, G: Tensor, kappa: Tensor, c, P: Tensor | None):
    """(U_new^-1, H U_new^-1, LAPACK's info) by the rank-m Woodbury update of U^-1:
    B^-1 = (1/c)(I + H^T diag(kappa) (I_m - G diag(kappa))^-1 X), G = X H^T: no division by g_q."""
    S = torch.eye(X.shape[0], dtype=X.dtype, device=X.device) - G * kappa[None, :]
    XUinv = fwd.HUinv if P is None else X @ state.Uinv
    R, info = torch.linalg.solve_ex(S, XUinv)  # _ex: a singular S is a flag, not a sync
    KR = kappa[:, None] * R
    return (state.Uinv + fwd.Hx.T @ KR) / c, (XUinv + G @ KR) / c, info


def by_products(state, U_new: Tensor, A: Tensor, c, rho: float | None, fold, deferred: bool):
    """(U_new^-1, whether it passed its check, the fold) from U^-1 by d x d products alone
    (inverse_update.py), or U_new^-1 None where this step solves instead. Device flags: the factors
    the flags' last read chose, and past their reach (the residual a flag) the step folds, U_new^-1
    = I after the fold; host checks: the factors rho needs, and a residual past the tolerance (U^-1
    had drifted) solves instead."""
    dtype = U_new.dtype
    factors = state.factors if deferred else neumann_factors(rho, float(state.cond_bound), dtype)
    if factors is None:
        return None, True, fold
    Uinv_new, residual = uinv_by_products(U_new, state.Uinv, A, c, factors)
    inverse_ok = residual <= residual_tolerance(dtype)
    if deferred:
        fold = fold | ~inverse_ok
        return torch.where(fold, torch.eye(U_new.shape[0], dtype=dtype, device=U_new.device), Uinv_new), True, fold
    return (Uinv_new, inverse_ok, fold) if bool(inverse_ok) else (None, True, fold)


def new_state(plan, state, fwd: SavedForward, lr, gq, gs, GA, ybar, Z, dH) -> NewState:
    """The step's new state from ``state`` (state.py's ``StepState``), computed aside: nothing of it
    changes here. ``lr``: under device flags a device scalar."""
    Hx, deferred = fwd.Hx, plan.deferred
    m, w = Hx.shape
    c = 1.0 - lr * plan.weight_decay  # > 0: forward checked lr * weight_decay < 1
    kappa = (2.0 * lr / c) * gq  # B = c (I - A), A = H^T diag(kappa) H P
    # The right preconditioner P (preconditioner.py; None: P = I). X = H P, the update's side of
    # H, is formed where a route takes it whole (Woodbury, the solve, Q through M); the products
    # route with Q from d x d products takes P in d x d products instead.
    moments = None if plan.preconditioner is None else \
        plan.preconditioner.update_moments(state.input_moment, state.input_moment_weight, Hx, fwd.real)
    P = None if moments is None else moments.P
    route, by_factors = inverse_route(plan, m), m > plan.m_matrix_rows  # Q's update from d x d products (else M)
    takes_x = not (route == "products" and by_factors)
    X = Hx if P is None else Hx @ P if takes_x else None
    use_woodbury = route == "woodbury"
    Gq = GqP = None  # H^T diag(g_q) H and G_q P, formed once where B is: its bounds, U B, the products, Q's update
    if use_woodbury:  # A's nonzero eigenvalues are those of the m x m diag(kappa) G, G = X H^T = H P H^T
        G = X @ Hx.T
        A, sq = kappa[:, None] * G, G.diagonal()  # h^T P h
        U_new = torch.addmm(c * state.U, fwd.HUt.T, (-2.0 * lr) * gq[:, None] * X)  # U B, reusing H U^T
    else:
        Gq = Hx.T @ (gq[:, None] * Hx)
        GqP = Gq if P is None else Gq @ P
        A = (2.0 * lr / c) * GqP
        U_new = state.U @ (c * torch.eye(w, dtype=A.dtype, device=A.device) - (2.0 * lr) * GqP)  # U B
        sq = Hx.pow(2).sum(1)  # ||h||^2, times P's largest eigenvalue's bound: >= h^T P h
        if P is not None:
            sq = sq * plan.preconditioner.max_eig
    rho_bound = None  # device flags, the adaptive Neumann rule: A's spectral radius bound, kept by the write
    eig = (0, 0)  # host checks: (eigenvalue computations, failures), counted by backward
    if deferred:  # bounds on the device; a nearly singular step's fold decided there too (a device bool)
        fold, cond_step, rho_bound = device_bounds(plan, state.cond_bound, A, sq, kappa)
        rho = None
    else:
        fold, cond_step, rho, eig = fold_and_cond(plan, A, sq, kappa)
    omega_new = Hx.T @ (2.0 * gq * fwd.ht + gs)  # X^T (...) = P H^T (...)
    omega_new = c * state.omega - lr * (omega_new if P is None else P @ omega_new)
    info, inverse_ok, right = None, True, None
    if fold is True:  # host checks: the fold decided on the host
        Uinv_new, HUinv_new = None, Hx @ P if X is None else X  # V absorbs U B; U = U^-1 = I
    elif route == "woodbury":
        Uinv_new, HUinv_new, info = by_woodbury(state, fwd, X, G, kappa, c, P)
    else:
        Uinv_new, inverse_ok, fold = (None, True, fold) if route != "products" else \
            by_products(state, U_new, A, c, rho, fold, deferred)
        if Uinv_new is not None:  # H U_new^-1 = X U_new^-1 = H (P U_new^-1)
            right = Uinv_new if P is None else P @ Uinv_new
            HUinv_new = Hx @ right
        else:  # H U_new^-1 by one solve; U^-1 itself is left stale until it is needed
            HUinv_new, info = solve_right(U_new, Hx @ P if X is None else X)
    if deferred and right is None:  # Woodbury, the solve: a singular solve folds too; after a fold
        # (a device bool) H U_new^-1 = X = H P and U_new^-1 = I, whatever the route made
        fold, info = fold | (info != 0).any(), None
        folded = cpu_flag(plan, fold)
        if folded is not False:
            HUinv_new = X if folded is True else torch.where(fold, X, HUinv_new)
            if Uinv_new is not None:
                eye = torch.eye(w, dtype=Hx.dtype, device=Hx.device)
                Uinv_new = eye if folded is True else torch.where(fold, eye, Uinv_new)
    # The exact bookkeeping of Q = W^T W and wbar = W^T 1: Q through M = dO dO^T (m x m), or
    # from d x d products of the step's factors, whichever has fewer multiply-adds.
    order = None  # the ids' sort, where Yd Yd^T H makes one: the write's scatter then sorts nothing
    if not by_factors:
        yy = lk.sparse_gram(fwd.idx, GA) if fwd.neg is None else fwd.neg.gram(plan, fwd.idx, GA)  # Yd Yd^T
        M = lk.m_matrix(fwd.Hq, Hx, Z, gq, gs, ybar, plan.num_classes, yy)
        Q_new = lk.q_update(state.Q, X, dH, M, lr, c)
    else:  # H^T Yd Yd^T H without Yd Yd^T: Yd Yd^T H by rows (and shared negatives' block as N^T N)
        order = lk.SortedIds.of(fwd.idx)
        YYH, HYYH = (lk.gram_rows(fwd.idx, GA, Hx, order=order), None) if fwd.neg is None else \
            fwd.neg.gram_terms(fwd.idx, GA, Hx, order)
        Q_new = lk.q_update_factors(state.Q, Hx, gq, Z, gs, ybar, plan.num_classes, YYH, lr, c, P=P, Gq=Gq,
                                    GqP=GqP, HYYH=HYYH)
    wbar_new = Hx.T @ (2.0 * gq * fwd.s + plan.num_classes * gs + ybar)
    wbar_new = c * state.wbar - lr * (wbar_new if P is None else P @ wbar_new)
    total = U_new.sum() + omega_new.sum() + HUinv_new.sum() + Q_new.sum() + wbar_new.sum()
    if Uinv_new is not None:
        total = total + Uinv_new.sum()
    ok = torch.isfinite(total)  # NaN and inf survive a sum
    if cond_step is None:  # the eigenvalues of B could not be computed: skip the step (host checks only)
        ok = torch.zeros_like(ok)
        cond_step = math.inf
    if info is not None:
        ok &= (info == 0).all()
    ok &= inverse_ok
    if moments is not None:
        ok &= moments.ok & torch.isfinite(moments.P.sum())
    return NewState(GA=GA, U=U_new, Uinv=Uinv_new, omega=omega_new, Q=Q_new, wbar=wbar_new, HUinv=HUinv_new,
                    fold=fold, cond_step=cond_step, ok=ok, lr=lr, moments=moments, order=order, right=right,
                    rho=rho_bound, eig=eig)


def write(plan, state, fwd: SavedForward, new: NewState, ok: Tensor | bool = True) -> None:
    """Write the step's new state into ``state`` (the head's buffers), a fold decided on the host
    excepted (``backward`` folds first). Under device flags every buffer keeps its old value where
    the flag ``ok`` is false, by ``torch.where``: no host read, no branch; ``ok`` read already
    (a Python bool: ``cpu_flag``), the write is taken whole or not at all."""
    masked = plan.deferred and isinstance(ok, Tensor)
    if plan.deferred:  # a fold decided on the device: V <- V U B where it is set, U = I (no host read)
        write_masked_u(plan, state, new, ok)
        if ok is False:
            return
    elif not new.fold:
        state.U.copy_(new.U)
        if new.Uinv is not None:
            state.Uinv.copy_(new.Uinv)
        state.cond_bound.copy_(state.cond_bound * new.cond_step)
    sh = plan.collectives
    rows = fwd.idx if plan.processes == "none" else sh.local_idx(fwd.idx)  # sharded: only this rank's rows of V
    GA, HUinv = (torch.where(ok, new.GA, 0.0), torch.where(ok, new.HUinv, 0.0)) if masked else (new.GA, new.HUinv)
    lk.scatter_add_rows_(state.V, rows, GA, HUinv, -new.lr, order=new.order if plan.processes == "none" else None)
    if fwd.neg is not None and fwd.neg.shared:  # the block's rows of V: one GEMM, one index_add_
        fwd.neg.scatter_(state.V, HUinv, -new.lr, ok if masked else None, sh, new.right)
    Q = 0.5 * (new.Q + new.Q.T)
    if masked:
        state.omega.copy_(torch.where(ok, new.omega, state.omega))
        state.Q.copy_(torch.where(ok, Q, state.Q))
        state.wbar.copy_(torch.where(ok, new.wbar, state.wbar))
    else:
        state.omega.copy_(new.omega)
        state.Q.copy_(Q)
        state.wbar.copy_(new.wbar)
    if new.moments is not None:
        new.moments.write(state, ok if masked else None)


def write_masked_u(plan, state, new: NewState, ok: Tensor) -> None:
    """U, U^-1 and cond(U)'s bound under device flags, each kept where ``ok`` is false; a fold
    (``new.fold``, a device bool) first takes V <- V U B in one gated pass over V's rows (one load
    a block where it is not set: ``lk.fold_rows_``) and leaves U = U^-1 = I, the bound 1. ``ok``
    read already (a Python bool, ``cpu_flag``): the fold's flag read too, the same values unmasked."""
    if not isinstance(ok, Tensor):
        write_read_u(plan, state, new, ok)
        return
    fold = new.fold & ok
    lk.fold_rows_(state.V, new.U, fold)  # (sharded: the rows this rank holds)
    eye = torch.eye(plan.width, dtype=state.U.dtype, device=state.U.device)
    state.U.copy_(torch.where(fold, eye, torch.where(ok, new.U, state.U)))
    if new.Uinv is not None:  # (the solve leaves U^-1 stale: run_device_part marks it so)
        state.Uinv.copy_(torch.where(ok, new.Uinv, state.Uinv))  # (new_state made it I where the step folds)
    if new.rho is not None:  # the largest since the flags' last read (driver.py's ``DeviceFlags``: the adaptive Neumann rule)
        state.rho_max.copy_(torch.maximum(state.rho_max, new.rho))
    grown = torch.where(fold, 1.0, state.cond_bound * new.cond_step)
    state.cond_bound.copy_(torch.where(ok, grown, state.cond_bound))
    state.cond_estimate.copy_(torch.where(fold, 1.0, state.cond_estimate))
    state.folds.add_(fold)


def write_read_u(plan, state, new: NewState, ok: bool) -> None:
    """``write_masked_u`` with ``ok`` a Python bool (``cpu_flag``): the same values, unmasked."""
    if new.rho is not None:  # the largest since the flags' last read, as the masked write keeps it
        state.rho_max.copy_(torch.maximum(state.rho_max, new.rho))
    if not ok:
        return
    if cpu_flag(plan, new.fold):
        lk.fold_rows_(state.V, new.U, True)
        state.U.copy_(torch.eye(plan.width, dtype=state.U.dtype, device=state.U.device))
        state.cond_bound.fill_(1.0)
        state.cond_estimate.fill_(1.0)
        state.folds.add_(1)
    else:
        state.U.copy_(new.U)
        state.cond_bound.copy_(state.cond_bound * new.cond_step)
    if new.Uinv is not None:  # (new_state made it I where the step folds)
        state.Uinv.copy_(new.Uinv)


# -- the device step: the whole step under device flags, a function of the plan and tensors -------
@torch.no_grad()
def update(plan, state, fwd: SavedForward, grad: Tensor | None, lr: Tensor) -> tuple[Tensor, Flags]:
    """dL/dH and the update under device flags: every check a flag that masks the write (a bad
    batch changes nothing), the step counted on the device (taken where ok, else skipped); it
    reads nothing on the host. ``grad``: the upstream gradient (None: 1)."""
    dH, gq, gs, GA, ybar, Z = hidden_grad(plan, state, fwd, grad, parts=True)
    ok = fwd.input_ok & torch.isfinite(fwd.Hx.sum() + gq.sum() + gs.sum() + GA.sum())
    new = new_state(plan, state, fwd, lr, gq, gs, GA, ybar, Z, dH)
    ok = ok & new.ok
    taken = cpu_flag(plan, ok)
    write(plan, state, fwd, new, taken)
    state.steps.add_(ok)
    state.skipped_nonfinite.add_(~ok)
    dH = torch.where(ok, dH, 0.0) if isinstance(taken, Tensor) else dH if taken else torch.zeros_like(dH)
    return dH, Flags(ok, new.fold, fwd.idx if plan.negatives == "kernel" else None)


@torch.no_grad()
def device_step(plan, state, batch: Batch, lr: Tensor, draws: Tensor | None) -> tuple[Tensor, Tensor, StepState, Flags]:
    """The whole step under device flags: forward, dL/dH, the checks as flags, the write masked by
    them, the device counts; it reads nothing on the host and takes no head (what
    ``torch.compile(fullgraph=True)`` takes whole, and a CUDA graph replays). (the loss, dL/dH
    (m, width), the new state: ``state`` itself, written in place, the flags)."""
    loss, fwd = forward(plan, state, batch, draws)
    dH, flags = update(plan, state, fwd, None, lr)
    return loss, dH, state, flags


def records_forward(plan, state, Hx: Tensor, idx: Tensor, gq: Tensor, gs: Tensor, GA: Tensor, real,
                    input_ok: Tensor | bool = True, cols: Tensor | None = None,
                    G_neg: Tensor | None = None) -> SavedForward:
    """Exact accumulation's records as a forward had made them: their products with the current
    state, and their shared negatives as one block (``cols``, ``G_neg``; per row: slots of idx)."""
    route = inverse_route(plan, Hx.shape[0])
    _, s, _, Hq, HUt, HUinv, ht = outputs(plan, state, Hx, None, with_uinv=route == "woodbury")
    neg = None if plan.sampling is None else plan.sampling.slots_part() if cols is None else \
        plan.sampling.records_block(plan, state, cols, G_neg)
    return SavedForward(Hx, idx, Hq, HUt, HUinv, ht, s, gq, gs, GA, input_ok, neg=neg, real=real)


@torch.no_grad()
def records_step(plan, state, Hx: Tensor, idx: Tensor, gq: Tensor, gs: Tensor, GA: Tensor, real, input_ok: Tensor,
                 cols: Tensor | None, G_neg: Tensor | None, lr: Tensor) -> tuple[Tensor, Flags]:
    """Exact accumulation's step under device flags, whole (as ``device_step``)."""
    return update(plan, state, records_forward(plan, state, Hx, idx, gq, gs, GA, real, input_ok, cols, G_neg),
                  None, lr)
