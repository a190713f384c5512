"""The exact step of the factored head, in docs/algorithm.md's order: forward (q, s, A; the loss
and its gradients), backward (dL/dH), the new state computed aside, its checks, the write.

The step is functions of the plan (plan.py's ``StepPlan``: every mode settled, and the function of
each choice), the state (state.py's ``StepState``: the head's buffers, gathered) and the batch;
none takes the head (its part of a step is driver.py's), and the step branches only on its plan
and on the batch's shape. ``device_step(plan, state, batch, lr, draws, route)`` is the whole step, every
check a flag masking the write: the one unit driver.py compiles whole and a CUDA graph replays
(``sync_every > 1``: nothing read on the host); the autograd step runs its halves (``forward``,
``update``), exact accumulation ``records_step``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

import lst_kernels as lk

from .inverse_update import residual_tolerance, uinv_by_products
from .state import StepState


class Unexchanged:
    """The exchange of a batch of one process's own rows: every rank sent its rows."""

    def note_fault(self, first, bad, step) -> None:
        """No fault to note: every rank sent its rows."""

    def checked(self, input_ok):
        return input_ok


UNEXCHANGED = Unexchanged()


class Batch(NamedTuple):
    """A training batch as the step takes it: H augmented, target ids (-1: padding), their values,
    the real rows the "mean" reduction divides by, a device count (None: idx's rows), and the
    fixed-size exchange the ranks' rows came through (padded_rows.py; else ``Unexchanged``)."""
    Hx: Tensor
    idx: Tensor
    T: Tensor
    rows: Tensor | None = None
    exchange: object = UNEXCHANGED


class Flags(NamedTuple):
    """What a device step leaves for the host to read: ``ok`` (a device bool: the write was taken)
    and ``fold`` (the step folded into V)."""
    ok: Tensor
    fold: Tensor | bool
    uinv: bool = True  # U_new^-1 made (the solve route leaves U^-1 behind)


class Route(NamedTuple):
    """One way to make H U_new^-1 (docs/algorithm.md, "The update"), as the plan holds it for its
    checks (``step_route`` picks the route of a batch's rows)."""
    name: str            # "woodbury", "solve" or "products"
    forms: Callable      # B's forms: the m x m ones (Woodbury) or the d x d ones, and U B
    inverse: Callable    # H U_new^-1 (an ``Inverse``)
    blocks: int          # the products with H of the forward's one GEMM: H Q, H U^T, and H U^-1 (Woodbury)
    takes_x: bool        # X = H P formed whatever Q's route (the products and the solve: only for Q through M)
    keeps_uinv: bool     # U^-1 made with the step (the solve leaves it stale)


@dataclass
class SavedForward:
    """What the forward computed that the backward and the update reuse."""
    Hx: Tensor
    idx: Tensor
    Hq: Tensor      # H Q
    HUt: Tensor      # H U^T
    HP: Tensor      # H [Q, U^T] (Woodbury: H [Q, U^T, U^-1]), the forward's one GEMM
    ht: Tensor      # H omega
    s: Tensor       # rowsum of the output
    gq: Tensor
    gs: Tensor
    GA: Tensor
    route: Route    # the U^-1 route of this batch's rows
    input_ok: Tensor | bool = True  # device flags: False when the batch had bad target ids
    neg: object = None  # the sampled classes' part (negatives.py: SharedBlock, PerRowSlots), or TARGETS_ONLY
    real: Tensor | None = None  # the rows with a target (the preconditioner's moments count these only)


def writes_nothing(*_) -> None:
    """The write of a part the plan does not have (no shared block, P off): nothing."""


class NoMoments:
    """P off: no moments to write."""
    write = staticmethod(writes_nothing)


NO_MOMENTS = NoMoments()


@dataclass
class NewState:
    """Everything one step changes, computed aside so a failure leaves the head untouched."""
    GA: Tensor               # dL/dA, scaled by the upstream gradient
    U: Tensor
    Uinv: Tensor             # U_new^-1; the solve's: U^-1 as it was, stale (the step solved with U instead)
    omega: Tensor
    Q: Tensor
    wbar: Tensor
    HUinv: Tensor            # H U_new^-1: the rows scattered into V
    fold: Tensor             # a nearly singular step: U B is folded into V (a device bool)
    ok: Tensor               # device bool: all of it finite, every solve regular
    cond_step: Tensor  # bound on cond(B): the carried bound on cond(U) grows by it
    lr: Tensor
    moments: object  # the preconditioner's new moments (preconditioner.Moments); P off: NO_MOMENTS, none to write
    order: lk.SortedIds | None = None  # the step's ids sorted once (the gram_rows route), for the write's scatter
    right: Tensor | None = None  # R with H U_new^-1 = H R (R = P U_new^-1: the products and the solve); else None
    rho: Tensor | None = None  # a bound on A's spectral radius (the adaptive rule keeps it)
    N: Tensor | None = None  # shared negatives, Q from d x d products: G_u^T H (``gram_terms``), for the write


class TargetsOnly:
    """The step's part of the sampled classes when there are none (the plan's ``slots``): Yd's
    Gramian terms of the target slots alone, no rows of a block to write (``write`` scatters a
    ``shared`` block's only: ``scatter_`` writes nothing here)."""
    shared = False
    scatter_ = staticmethod(writes_nothing)

    def slots_part(self) -> "TargetsOnly":
        return self

    def gram(self, plan, idx: Tensor, GA: Tensor) -> Tensor:
        """Yd Yd^T (m x m)."""
        return plan.kernels.sparse_gram(idx, GA)

    def gram_terms(self, plan, idx: Tensor, GA: Tensor, H: Tensor, order: lk.SortedIds | None = None):
        """(Yd Yd^T H by rows, ``gram_rows``; nothing given whole, no N)."""
        return plan.kernels.gram_rows(idx, GA, H, order), None, None


TARGETS_ONLY = TargetsOnly()

# -- the loss on m-sized tensors --------------------------------------------------------------
def y_sq(idx: Tensor, T: Tensor) -> Tensor:
    """||y||^2 per row, with repeated classes in a row summed first (the squared error)."""
    same = (idx[:, :, None] == idx[:, None, :]) & (idx[:, :, None] >= 0)
    return (T[:, :, None] * T[:, None, :] * same).sum((1, 2))


def sum_weights(real: Tensor, dtype: torch.dtype, rows: Tensor | None = None) -> Tensor:
    """d reduce(per) / d per (m,) of the "sum" reduction (``ROW_WEIGHTS``) from ``real`` (m,), the
    rows with a real slot: 1 on them, 0 on a fully padded row."""
    return real.to(dtype)


def mean_real_weights(real: Tensor, dtype: torch.dtype, rows: Tensor | None = None) -> Tensor:
    """"mean_real"'s: 1/n on the real rows, n of them, 0 on a fully padded row."""
    return real.to(dtype) / real.sum().clamp_min(1)


def mean_weights(real: Tensor, dtype: torch.dtype, rows: Tensor | None = None) -> Tensor:
    """"mean"'s: 1/n on the real rows, 0 on a fully padded row, n all the rows (``rows``, a device
    count, the ranks' rows of a gathered batch padded to their capacity, ``processes.rows``; None: m)."""
    return real.to(dtype) / (real.shape[0] if rows is None else rows)


#: the row weights of each reduction (base.py's ``REDUCTIONS``): the plan's ``row_weights``
ROW_WEIGHTS = {"sum": sum_weights, "mean_real": mean_real_weights, "mean": mean_weights}


def reduce(per_example: Tensor, weight: Tensor) -> Tensor:
    """The minibatch loss from per-example losses, ``sum_i weight_i l_i`` (``ROW_WEIGHTS``); a fully
    padded row (every slot -1) contributes nothing, whatever its loss, for every loss (the squared
    error would see a zero target)."""
    return (torch.where(weight != 0, per_example, torch.zeros((), dtype=weight.dtype, device=weight.device))
            * weight).sum()


# -- forward ---------------------------------------------------------------------------------
def outputs(plan, state, Hx: Tensor, blocks: int = 2):
    """q, s and the products reused by backward: ``HP`` = H [Q, U^T] in one GEMM, with ``blocks`` 3
    H [Q, U^T, U^-1] (the Woodbury route takes its last block), H Q and H U^T its first two; H omega.
    The target outputs are ``plan.gather_dot(V, idx, H U^T, H omega)``."""
    d = plan.width
    HP = Hx @ torch.cat((state.Q, state.U.T, state.Uinv)[:blocks], dim=1)
    Hq, HUt = HP[:, :d], HP[:, d:2 * d]
    q = (Hx * Hq).sum(1)
    s = Hx @ state.wbar
    ht = Hx @ state.omega
    return q, s, Hq, HUt, HP, ht


def step_route(plan, m: int) -> Route:
    """The U^-1 route of a step of m rows, as its plan says: Woodbury up to ``woodbury_rows`` rows.
    Chosen on the host before the step (driver.py), for the rows the device part takes (padded:
    the batch size)."""
    return plan.few_rows if m <= plan.woodbury_rows else plan.many_rows


def screen(plan, state, idx: Tensor, T: Tensor, exchange=UNEXCHANGED):
    """Device flags: bad ids become padding and the step is void (``input_ok`` False); the first
    such step since the last read is recorded (``state.bad_input``: its number, from 1)."""
    bad = (idx < -1) | (idx >= plan.num_classes)
    input_ok = ~bad.any()
    first = (state.bad_input == 0) & ~input_ok
    state.bad_input.copy_(torch.where(first, state.steps + state.skipped_nonfinite + 1, state.bad_input))
    return torch.where(bad, -1, idx), torch.where(bad, 0.0, T), input_ok


def screen_exchanged(plan, state, idx: Tensor, T: Tensor, exchange):
    """``screen`` of several processes' rows, exchanged padded to their capacity (``exchange``:
    padded_rows.py): a rank that sent none voids the step too, and the first void step's rank is
    recorded."""
    bad = (idx < -1) | (idx >= plan.num_classes)
    input_ok = exchange.checked(~bad.any())
    first = (state.bad_input == 0) & ~input_ok
    step = state.steps + state.skipped_nonfinite + 1
    state.bad_input.copy_(torch.where(first, step, state.bad_input))
    exchange.note_fault(first, bad, step)
    return torch.where(bad, -1, idx), torch.where(bad, 0.0, T), input_ok


@torch.no_grad()
def forward(plan, state, batch: Batch, draws: Tensor | None, route: Route) -> tuple[Tensor, SavedForward]:
    """The loss and what the backward reuses: q, s, A, the loss gradients and the products with H.
    ``draws``: the host's uniforms of the sampled classes (``before_step``; None without them);
    ``route``: the U^-1 route of the batch's rows, chosen before the step (``step_route``)."""
    Hx, idx, T, rows, exchange = batch
    idx, T, input_ok = plan.screen(plan, state, idx, T, exchange)  # device flags: bad ids a flag
    q, s, Hq, HUt, HP, ht = outputs(plan, state, Hx, route.blocks)
    A = plan.gather_dot(state.V, idx, HUt, ht)
    real = (idx >= 0).any(1)  # the rows with a target: the loss's weights, P's moments
    # the minibatch loss and its gradients dL/dq (m), dL/ds (m), dL/dA (m, K): in closed form
    # where the loss has one (Loss.grads; autograd on these m-sized tensors otherwise)
    y2 = y_sq(idx, T) if plan.loss.needs_y_sq else None  # ||y||^2 where the loss takes it (sampled: the spherical term)
    weight = plan.row_weights(real, q.dtype, rows)
    if plan.sampling is None:
        per, gq, gs, GA = plan.loss.grads(q, s, A, T, weight, num_classes=plan.num_classes, y_sq=y2)
        neg = TARGETS_ONLY
    else:  # sampled classes as slots (negatives.py)
        per, gq, gs, GA, idx, neg = plan.slots.loss_and_grads(plan, state, q, s, A, idx, T, HUt, ht, draws, weight, y2)
    return reduce(per, weight), SavedForward(Hx, idx, Hq, HUt, HP, ht, s, gq, gs, GA, route, input_ok, neg, real)


# -- backward ------------------------------------------------------------------------------------
@torch.no_grad()
def hidden_grad(plan, state, fwd: SavedForward, grad: Tensor | None):
    """dL/dH = dO W without dO: Z = (g_s 1^T + Yd) W, plus 2 g_q H Q. Nothing changes. ``grad``: the
    upstream gradient (None: 1, the fused step's). (dL/dH = dO W, and the parts the update reuses:
    g_q, g_s, G_A scaled, ybar, Z, and the forward the update takes: a new ``SavedForward`` where
    shared negatives' block holds the step's gradients)."""
    gq, gs, GA = (fwd.gq, fwd.gs, fwd.GA) if grad is None else (fwd.gq * grad, fwd.gs * grad, fwd.GA * grad)
    YV, ybar = plan.gather_sum(state.V, fwd.idx, GA), GA.sum(1)
    if plan.negatives == "shared":  # one dense block (negatives.py): the step's, with its gradients
        YV, ybar, neg = fwd.neg.hidden(plan, grad, YV, ybar)
        fwd = dataclasses.replace(fwd, neg=neg)
    Z = YV @ state.U + torch.outer(ybar, state.omega) + torch.outer(gs, state.wbar)
    dOW = torch.addcmul(Z, gq[:, None], fwd.Hq, value=2.0)  # dO W = Z + 2 diag(g_q) H Q: dL/dH
    return dOW, gq, gs, GA, ybar, Z, fwd


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


class Bounds(NamedTuple):
    """What ``device_bounds`` makes of B's eigenvalues (device scalars): whether the step folds, a
    bound on cond(B), and one on A's spectral radius (the products' factors read it at the flags' read)."""
    fold: Tensor
    cond_step: Tensor
    rho: Tensor


def device_bounds(plan, state, A: Tensor, sq: Tensor, kappa: Tensor) -> Bounds:
    """Device flags: the fold, a bound on cond(B) and the bound on A's spectral radius (which the
    adaptive Neumann rule reads), as device tensors, from the bounds of B = c (I - A) (``eig_bounds``), with no
    host read: the step is folded into V where the bounds cannot rule out an eigenvalue of B/c within
    ``fold_tol`` of 0, or where cond(U)'s bound would pass ``fold_cond`` (docs/factored_head.md,
    "Nearly singular steps")."""
    rho_pos, rho_neg = eig_bounds(A, sq, kappa)
    rho = torch.maximum(rho_pos, rho_neg)
    cond_step = torch.where(rho_pos < 1, (1 + rho_neg) / (1 - rho_pos).clamp_min(1e-30), math.inf)
    fold = (rho_pos > 1 - plan.fold_tol) | (state.cond_bound * cond_step > plan.fold_cond)
    return Bounds(fold, cond_step, rho)


def solve_right(U: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """(X U^-1, LAPACK's info: > 0 where U is singular), as ``torch.linalg.solve_ex(U, X,
    left=False)`` but by its LU and two triangular solves from the right, in the column order
    of the pivots: 0.46 against 0.55 ms at m = 256, d = 129 on one CPU thread."""
    LU, pivots, info = torch.linalg.lu_factor_ex(U)  # U = P L R
    Y = torch.linalg.solve_triangular(LU, X, upper=True, left=False)  # (X P L) R = X U
    Y = torch.linalg.solve_triangular(LU, Y, upper=False, unitriangular=True, left=False)  # X P
    P = torch.lu_unpack(LU, pivots, unpack_data=False)[0]
    return Y.index_select(1, P.argmax(1)), info  # X = (X P) P^T



# -- B's forms, as a route takes them ------------------------------------------------------------
class Forms(NamedTuple):
    """X = H P (None where no route takes it whole), A with B = c (I - A), ``sq`` (m,) h^T P h or a
    bound on it, U B, and G = X H^T (Woodbury) or H^T diag(g_q) H and G_q P (the d x d forms)."""
    X: Tensor | None
    A: Tensor
    sq: Tensor
    U: Tensor
    G: Tensor | None = None
    Gq: Tensor | None = None
    GqP: Tensor | None = None


def woodbury_forms(plan, state, fwd: SavedForward, P, lr, c, kappa: Tensor, gq: Tensor, X: Tensor) -> Forms:
    """A's nonzero eigenvalues are those of the m x m diag(kappa) G, G = X H^T = H P H^T (its
    diagonal: h^T P h); U B reusing H U^T."""
    G = X @ fwd.Hx.T
    U_new = torch.addmm(c * state.U, fwd.HUt.T, (-2.0 * lr) * gq[:, None] * X)
    return Forms(X, kappa[:, None] * G, G.diagonal(), U_new, G)


def square_forms(plan, state, fwd: SavedForward, P, lr, c, kappa: Tensor, gq: Tensor, X) -> Forms:
    """A = (2 lr / c) H^T diag(g_q) H P, d x d, formed once: its bounds, U B, the products, Q's
    update; ``sq`` ||h||^2, times P's largest eigenvalue's bound: >= h^T P h."""
    Hx = fwd.Hx
    Gq = GqP = Hx.T @ (gq[:, None] * Hx)
    sq = Hx.pow(2).sum(1)
    if P is not None:
        GqP, sq = Gq @ P, sq * plan.preconditioner.max_eig
    U_new = state.U @ (c * torch.eye(plan.width, dtype=Hx.dtype, device=Hx.device) - (2.0 * lr) * GqP)  # U B
    return Forms(X, (2.0 * lr / c) * GqP, sq, U_new, None, Gq, GqP)


# -- the U^-1 routes: H U_new^-1 by Woodbury, by products of U^-1 or by a solve (solve_right) -----
class Inverse(NamedTuple):
    """A route's H U_new^-1: U_new^-1 (the solve: U^-1 as it was, stale), the fold (a singular solve or a residual
    past the products' reach folds too) and R with H U_new^-1 = H R (the products and the
    solve: R = P U_new^-1; Woodbury: None)."""
    Uinv: Tensor
    HUinv: Tensor
    fold: Tensor | bool
    total: Tensor            # the sum of H U_new^-1 (and U_new^-1): finite where they are
    right: Tensor | None = None


# Woodbury: the rank-m update of U^-1, B^-1 = (1/c)(I + H^T diag(kappa) (I_m - G diag(kappa))^-1 X),
# G = X H^T: no division by g_q; X U^-1 = H U^-1 from the forward's GEMM where P = I.
# A singular solve folds; after a fold (a device bool) H U_new^-1 = X = H P and U_new^-1 = I,
# whatever the route made. Past the products' reach (the residual a flag) the step folds too;
# their Neumann factors are ``state.factors``: those the flags' last read chose.
def woodbury(plan, state, fwd: SavedForward, f: Forms, P, c, kappa: Tensor, bounds: Bounds) -> Inverse:
    S = torch.eye(f.X.shape[0], dtype=f.X.dtype, device=f.X.device) - f.G * kappa[None, :]
    XUinv = fwd.HP[:, 2 * plan.width:] if P is None else f.X @ state.Uinv
    R, info = torch.linalg.solve_ex(S, XUinv)  # _ex: a singular S is a flag, not a sync
    KR = kappa[:, None] * R
    Uinv, HUinv = (state.Uinv + fwd.Hx.T @ KR) / c, (XUinv + f.G @ KR) / c
    fold = bounds.fold | (info != 0).any()
    eye = torch.eye(plan.width, dtype=HUinv.dtype, device=HUinv.device)
    Uinv, HUinv = torch.where(fold, eye, Uinv), torch.where(fold, f.X, HUinv)
    return Inverse(Uinv, HUinv, fold, HUinv.sum() + Uinv.sum())


def solve(plan, state, fwd: SavedForward, f: Forms, P, c, kappa: Tensor, bounds: Bounds) -> Inverse:
    # R = P U_new^-1 (d x d solves), H U_new^-1 = H R: one m d^2 GEMM, against X = H P and m x d
    # triangular solves with X; a shared block's scatter takes N R (u d^2)
    eye = torch.eye(plan.width, dtype=f.U.dtype, device=f.U.device)
    R, info = solve_right(f.U, eye if P is None else P)
    fold = bounds.fold | (info != 0).any()
    if P is None:  # masked after, as the products route (H I = H)
        HUinv = torch.where(fold, fwd.Hx, fwd.Hx @ R)
        right = torch.where(fold, eye, R)
    else:
        right = torch.where(fold, P, R)
        HUinv = fwd.Hx @ right
    return Inverse(state.Uinv, HUinv, fold, HUinv.sum() + right.sum(), right)


def products(plan, state, fwd: SavedForward, f: Forms, P, c, kappa: Tensor, bounds: Bounds) -> Inverse:
    Uinv, residual = uinv_by_products(f.U, state.Uinv, f.A, c, state.factors)
    fold = bounds.fold | ~(residual <= residual_tolerance(f.U.dtype))
    eye = torch.eye(plan.width, dtype=f.U.dtype, device=f.U.device)
    if P is None:  # H U_new^-1 from the inverse as made, masked after (H I = H): the product waits for no fold
        HUinv = torch.where(fold, fwd.Hx, fwd.Hx @ Uinv)
        Uinv = right = torch.where(fold, eye, Uinv)
    else:  # H U_new^-1 = X U_new^-1 = H (P U_new^-1), and H P after a fold
        Uinv = torch.where(fold, eye, Uinv)
        right = P @ Uinv
        HUinv = fwd.Hx @ right
    return Inverse(Uinv, HUinv, fold, HUinv.sum() + Uinv.sum(), right)


#: the three routes by name
ROUTES = {"woodbury": Route("woodbury", woodbury_forms, woodbury, 3, True, True),
          "solve": Route("solve", square_forms, solve, 2, False, False),
          "products": Route("products", square_forms, products, 2, False, True)}


def new_state(plan, state, fwd: SavedForward, lr, gq, gs, GA, ybar, Z, dOW) -> NewState:
    """The step's new state from ``state`` (state.py's ``StepState``), computed aside: nothing of it
    changes here. ``lr``: a device scalar; ``Z`` and ``dOW`` (dO W): ``hidden_grad``'s."""
    Hx, route = fwd.Hx, fwd.route
    by_m = Hx.shape[0] <= plan.m_matrix_rows  # Q's update through M (m x m), else from d x d products
    c = 1.0 - lr * plan.weight_decay  # > 0: forward checked lr * weight_decay < 1
    omega_new = Hx.T @ (2.0 * gq * fwd.ht + gs)
    wbar_new = Hx.T @ (2.0 * gq * fwd.s + plan.num_classes * gs + ybar)
    # The right preconditioner P (preconditioner.py): X = H P, the update's side of H, is formed where a
    # route takes it whole (Woodbury, the solve, Q through M); omega's and wbar's updates take P v.
    moments, P = NO_MOMENTS, None
    X, p_ok = Hx, True
    if plan.preconditioner is not None:
        Hr = torch.where(fwd.real[:, None], Hx, 0.0)  # the rows with a target: the moments count these only
        moments = plan.preconditioner.moments_of(state.input_moment, state.input_moment_weight, Hr.T @ Hr,
                                                 fwd.real.sum())
        P, p_ok = moments.P, moments.ok & torch.isfinite(moments.P.sum())
        X = Hx @ P if by_m or route.takes_x else None
        omega_new, wbar_new = P @ omega_new, P @ wbar_new
    # The exact bookkeeping of Q = W^T W: through M = dO dO^T (m x m), or from d x d products of
    # the step's factors, whichever has fewer multiply-adds; Q's update for an lr, as ``q_new(lr, c)``.
    order = N = None  # the ids' sort, where Yd Yd^T H makes one: the write's scatter then sorts nothing
    if by_m:
        M = plan.kernels.m_matrix(fwd.Hq, Hx, Z, gq, gs, ybar, plan.num_classes,
                                  fwd.neg.gram(plan, fwd.idx, GA))  # Yd Yd^T

        def q_new(lr, c, Gq=None, GqP=None):
            return plan.kernels.q_update(state.Q, X, dOW, M, lr, c)
    else:  # H^T Yd Yd^T H without Yd Yd^T: Yd Yd^T H by rows (and shared negatives' block as N^T N)
        order = plan.kernels.sorted_ids(fwd.idx)
        YYH, HYYH, N = fwd.neg.gram_terms(plan, fwd.idx, GA, Hx, order)

        def q_new(lr, c, Gq=None, GqP=None):
            return plan.kernels.q_update_factors(state.Q, Hx, gq, Z, gs, ybar, plan.num_classes, YYH, lr, c, P=P,
                                                 Gq=Gq, GqP=GqP, HYYH=HYYH)
    if plan.clip_norm is not None:  # the gradient G P scaled to at most clip_norm: lr by the factor
        # ||G P||^2 is the trace of Q's lr^2 term, (G P)^T (G P): Q's update at lr 1 without Q (c 0)
        norm = q_new(1.0, 0.0).diagonal().sum().clamp_min(0.0).sqrt()
        lr = lr * torch.clamp(plan.clip_norm / norm, max=1.0)
    kappa = (2.0 * lr / c) * gq  # B = c (I - A), A = H^T diag(kappa) H P
    omega_new = c * state.omega - lr * omega_new
    wbar_new = c * state.wbar - lr * wbar_new
    f = route.forms(plan, state, fwd, P, lr, c, kappa, gq, X)
    bounds = device_bounds(plan, state, f.A, f.sq, kappa)  # the fold and cond(B): device scalars
    inv = route.inverse(plan, state, fwd, f, P, c, kappa, bounds)
    Q_new = q_new(lr, c, f.Gq, f.GqP)
    total = f.U.sum() + omega_new.sum() + inv.total + Q_new.sum() + wbar_new.sum()
    ok = torch.isfinite(total) & p_ok  # NaN and inf survive a sum
    return NewState(GA=GA, U=f.U, Uinv=inv.Uinv, omega=omega_new, Q=Q_new, wbar=wbar_new, HUinv=inv.HUinv,
                    fold=inv.fold, cond_step=bounds.cond_step, ok=ok, lr=lr, moments=moments, order=order,
                    right=inv.right, rho=bounds.rho, N=N)


def write(plan, state, fwd: SavedForward, new: NewState, ok: Tensor) -> tuple[Tensor, Tensor]:
    """Write the step's new state into ``state`` (the head's buffers), each part kept where the
    device flag ``ok`` is false, on every device, eager or compiled: U, U^-1 (the solve's stale one
    kept) and cond(U)'s bound first, where a fold (a device bool) takes V <- V U B in one gated pass
    over V's rows (one load a block where it is not set: ``fold_rows_``) and leaves U = U^-1 = I, the
    bound 1; then the targets' rows of V, omega, Q and wbar. The whole write of a plan without parts
    of its own (``write_with_parts``). (H U_new^-1 masked by ``ok``, -lr: what a shared block's
    scatter takes.)"""
    fold = new.fold & ok
    plan.kernels.fold_rows_(state.V, new.U, fold)  # (sharded: the rows this rank holds)
    eye = torch.eye(plan.width, dtype=state.U.dtype, device=state.U.device)
    state.U.copy_(torch.where(fold, eye, torch.where(ok, new.U, state.U)))
    state.Uinv.copy_(torch.where(ok, new.Uinv, state.Uinv))  # (I where it folds; the solve: stale, marked so)
    grown = torch.where(fold, 1.0, state.cond_bound * new.cond_step)
    state.cond_bound[...] = torch.where(ok, grown, state.cond_bound)  # (through a view: ``update``)
    state.cond_estimate[...] = torch.where(fold, 1.0, state.cond_estimate)
    state.folds.add_(fold)
    Q = 0.5 * (new.Q + new.Q.T)
    GA, HUinv, omega, Q, wbar = (
        torch.where(ok, new.GA, 0.0), torch.where(ok, new.HUinv, 0.0), torch.where(ok, new.omega, state.omega),
        torch.where(ok, Q, state.Q), torch.where(ok, new.wbar, state.wbar))
    alpha = -torch.where(ok, new.lr, 0.0)  # a void step's lr may be nan (clip_norm's factor of a nan norm)
    plan.scatter_rows(state.V, fwd.idx, GA, HUinv, alpha, order=new.order)  # sharded: this rank's rows of V
    state.omega.copy_(omega)
    state.Q.copy_(Q)
    state.wbar.copy_(wbar)
    return HUinv, alpha


def write_with_parts(plan, state, fwd: SavedForward, new: NewState, ok: Tensor) -> None:
    """``write``, then what the plan's parts write, each kept where ``ok`` is false: a shared
    block's rows of V (after the targets': one GEMM), P's moments. A
    part the plan does not have writes nothing (``writes_nothing``). The plan's ``write`` where it
    has any of them."""
    HUinv, alpha = write(plan, state, fwd, new, ok)
    fwd.neg.scatter_(plan, state.V, HUinv, alpha, ok, new.right, new.N)
    new.moments.write(state, ok)


# -- the device step: the whole step under device flags, a function of the plan and tensors -------
@torch.no_grad()
def update(plan, state, fwd: SavedForward, grad: Tensor | None, lr: Tensor) -> tuple[Tensor, Flags]:
    """dL/dH and the update under device flags: every check a flag that masks the write (the plan's
    ``write``: a bad batch changes nothing), the step counted on the device (taken where ok, else
    skipped); it reads nothing on the host. ``grad``: the upstream gradient (None: 1). (dL/dH, zeros
    where the step is not taken, and the flags.)"""
    dOW, gq, gs, GA, ybar, Z, fwd = hidden_grad(plan, state, fwd, grad)
    ok = fwd.input_ok & torch.isfinite(fwd.Hx.sum() + gq.sum() + gs.sum() + GA.sum())
    new = new_state(plan, state, fwd, lr, gq, gs, GA, ybar, Z, dOW)
    ok = ok & new.ok
    # since the flags' last read, of the steps taken: the adaptive rule's (a void step's own bound, nan for a
    # non-finite batch, is not kept: the read takes the most factors after one). Each 0-dim float64 buffer is
    # written through a view (``buf[...] = value``): a compiled step's copy_ into one is lost (torch 2.11 to
    # 2.13, CPU; test_compiled.py)
    state.rho_max[...] = torch.where(ok, torch.maximum(state.rho_max, new.rho), state.rho_max)
    state.steps.add_(ok)
    state.skipped_nonfinite.add_(~ok)
    plan.write(plan, state, fwd, new, ok)
    return torch.where(ok, dOW, 0.0), Flags(ok, new.fold, fwd.route.keeps_uinv)


@torch.no_grad()
def device_step(plan, state, batch: Batch, lr: Tensor, draws: Tensor | None,
                route: Route) -> tuple[Tensor, Tensor, StepState, Flags]:
    """The whole step under device flags: forward, dL/dH, the checks as flags, the write masked by
    them, the device counts; it reads nothing on the host and takes no head (what
    ``torch.compile(fullgraph=True)`` takes whole, and a CUDA graph replays). ``route``: the batch's
    U^-1 route (``step_route``, chosen before the step). (the loss, dL/dH (m, width), the new state:
    ``state`` itself, written in place, the flags)."""
    loss, fwd = forward(plan, state, batch, draws, route)
    dH, flags = update(plan, state, fwd, None, lr)
    return loss, dH, state, flags


@torch.no_grad()
def records_step(plan, state, Hx: Tensor, idx: Tensor, gq: Tensor, gs: Tensor, GA: Tensor, real, input_ok: Tensor,
                 cols: Tensor | None, G_neg: Tensor | None, lr: Tensor, route: Route) -> tuple[Tensor, Flags]:
    """Exact accumulation's step under device flags, whole (as ``device_step``): ``update`` of the
    records as a forward had made them, their products with the current state (by ``route``, chosen
    before the step), and their shared negatives as one block (``cols``, ``G_neg``; per row: slots of idx)."""
    _, s, Hq, HUt, HP, ht = outputs(plan, state, Hx, route.blocks)
    neg = plan.slots.slots_part() if cols is None else plan.slots.records_block(plan, state, cols, G_neg)
    return update(plan, state, SavedForward(Hx, idx, Hq, HUt, HP, ht, s, gq, gs, GA, route, input_ok, neg=neg,
                                            real=real), None, lr)
