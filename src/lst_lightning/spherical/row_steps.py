"""Per-row step sizes on the sparse part of the update (``row_steps="adagrad"``).

The step's gradient of W is ``dO^T H`` with ``dO = 2 diag(g_q) O + g_s 1^T + Yd``: a dense part
(the factored head's U, omega) and a sparse one, ``Yd^T H``, on the rows of the batch's classes
(its targets and sampled classes). With row steps each class c keeps ``acc_c``, the sum over the
steps that touched it of ``||g_c||^2``, g_c = (Yd^T H)_c its row of the sparse part (the slots of c
summed first, the upstream gradient in, before P), and the update is

    acc <- acc + ||(Yd^T H)_c||^2 (per class c);   r_c = scale / sqrt(eps + acc_c)
    W <- (1 - lr wd) W - lr (2 O^T diag(g_q) H + 1 g_s^T H + diag(r) Yd^T H) P,

Adagrad's rule on the sparse rows, acc taken after this step's add. The body's dL/dH keeps the true
Yd. The factored head takes the step exactly: every place of the update that sees Yd (the scatter
into V, ybar in wbar's update, Z = (g_s 1^T + Yd) W and Yd Yd^T in Q's) sees Yd diag(r), one matrix;
the naive head (naive.py) takes it on its explicit W. ``acc`` is the heads' ``row_acc`` buffer (D,).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ROW_STEP_RULES = ("adagrad",)


@dataclass(frozen=True)
class RowSteps:
    """The rule (``ROW_STEP_RULES``), its scale and its eps, validated on construction."""
    rule: str = "adagrad"
    scale: float = 1.0
    eps: float = 1e-8

    def __post_init__(self):
        if self.rule not in ROW_STEP_RULES:
            raise ValueError(f"row_steps must be one of {ROW_STEP_RULES} or None, got {self.rule!r}")
        for name in ("scale", "eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"row_step_{name} must be a finite number > 0, got {v!r}")

    @classmethod
    def of(cls, rule, scale, eps) -> "RowSteps | None":
        return None if rule is None else cls(rule, scale, eps)

    def factors(self, acc: Tensor) -> Tensor:
        """r = scale / sqrt(eps + acc), acc the classes' accumulators after this step's add."""
        return self.scale * torch.rsqrt(acc + self.eps)

    # -- the factored step (exact_step.hidden_grad) ---------------------------------------------
    def scaled(self, plan, state, fwd, GA: Tensor, gs: Tensor):
        """The update's sparse part scaled by r: (G_A r, ybar, Z) of Yd diag(r); the shared
        negatives' block's ``G_u`` scaled in place (its scatter and Gramian read it). The classes'
        squared norms are left on ``fwd.row_sq`` for ``write_acc``. Static shapes (a compiled step)."""
        from .negatives import padded_unique  # noqa: PLC0415 (negatives.py imports exact_step)
        idx, neg, Hx = fwd.idx, fwd.neg, fwd.Hx
        m, K = idx.shape
        ids = idx.reshape(-1).clamp(min=0)  # padding: a zero row added to class 0's
        on = torch.where(idx >= 0, GA, torch.zeros((), dtype=GA.dtype, device=GA.device))
        rows = (on[:, :, None] * Hx[:, None, :].to(GA.dtype)).reshape(m * K, -1)  # each slot's part of g_c
        if neg.shared:  # the block's rows of Yd^T H, G_u^T H (its columns past u: zeros)
            ids = torch.cat([ids, neg.uniq])
            rows = torch.cat([rows, neg.G_u.T @ Hx.to(GA.dtype)])
        uniq, inv = padded_unique(ids)
        g = torch.zeros_like(rows).index_add_(0, inv, rows)  # each class's row g_c (entries past u: 0)
        sq = (g * g).sum(1)
        r = self.factors(state.row_acc.index_select(0, uniq).to(GA.dtype) + sq).index_select(0, inv)
        fwd.row_sq = (uniq, sq)
        GA = GA * r[:m * K].view(m, K)
        YV, ybar = plan.gather_sum(state.V, idx, GA), GA.sum(1)
        if neg.shared:
            neg.G_u = neg.G_u * r[m * K:]
            YV, ybar = torch.addmm(YV, neg.G_u, neg.V_u.to(YV.dtype)), ybar + neg.G_u.sum(1)
        Z = YV @ state.U + torch.outer(ybar, state.omega) + torch.outer(gs, state.wbar)
        return GA, ybar, Z


def write_acc(state, fwd, ok: Tensor | None) -> None:
    """acc_c += ||g_c||^2 at the step's classes (``scaled``), kept where the device flag ``ok`` is
    false (None: taken)."""
    uniq, sq = fwd.row_sq
    sq = sq if ok is None else torch.where(ok, sq, 0.0)
    state.row_acc.index_add_(0, uniq, sq.to(state.row_acc.dtype))
