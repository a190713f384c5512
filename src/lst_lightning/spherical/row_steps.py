"""Per-row step sizes on the sparse part of the update (``row_steps="adagrad"``).

The step's gradient of W is ``dO^T H`` with ``dO = 2 diag(g_q) O + g_s 1^T + Yd``: a dense part
(the factored head's U, omega) and a sparse one, ``Yd^T H``, on the rows of the batch's classes
(its targets and sampled classes). With row steps each class c keeps ``acc_c``, the sum over the
steps that touched it of ``||g_c||^2``, g_c = (Yd^T H)_c its row of the sparse part (the slots of c
summed first, the upstream gradient in, before P), and the update is, at the classes the step touches
(a target or a sampled class),

    "adagrad":  acc_c <- acc_c + ||g_c||^2,                         r_c = scale / sqrt(eps + acc_c)
    "rmsprop":  acc_c <- beta acc_c + (1 - beta) ||g_c||^2,
                w_c <- beta w_c + (1 - beta) (= 1 - beta^touches),  r_c = scale / sqrt(eps + acc_c / w_c)
    W <- (1 - lr wd) W - lr (2 O^T diag(g_q) H + 1 g_s^T H + diag(r) Yd^T H) P,

Adagrad's rule on the sparse rows, or RMSprop's lazily (a class's average moves only when a step
touches it, as row-sparse Adam's second moment does, bias-corrected by w_c), acc taken after this
step's update. The body's dL/dH keeps the true
Yd. The factored head takes the step exactly: every place of the update that sees Yd (the scatter
into V, ybar in wbar's update, Z = (g_s 1^T + Yd) W and Yd Yd^T in Q's) sees Yd diag(r), one matrix;
the naive head (naive.py) takes it on its explicit W. (acc, w) are the heads' ``row_acc`` buffer (D, 2)
(adagrad: w counts the touches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .negatives import padded_unique

ROW_STEP_RULES = ("adagrad", "rmsprop")


@dataclass(frozen=True)
class RowSteps:
    """The rule (``ROW_STEP_RULES``), its scale, eps and beta (rmsprop), validated on construction."""
    rule: str = "adagrad"
    scale: float = 1.0
    eps: float = 1e-8
    beta: float = 0.999

    def __post_init__(self):
        if self.rule not in ROW_STEP_RULES:
            raise ValueError(f"row_steps must be one of {ROW_STEP_RULES} or None, got {self.rule!r}")
        for name in ("scale", "eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"row_step_{name} must be a finite number > 0, got {v!r}")
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1:
            raise ValueError(f"row_step_beta must be a number in (0, 1), got {b!r}")

    @classmethod
    def of(cls, rule, scale, eps, beta) -> "RowSteps | None":
        return None if rule is None else cls(rule, scale, eps, beta)

    def advanced(self, acc: Tensor, sq: Tensor) -> Tensor:
        """(acc, w) (n, 2) of touched classes after a step whose ||g_c||^2 is ``sq`` (n,)."""
        if self.rule == "adagrad":
            return acc + torch.stack([sq, torch.ones_like(sq)], 1)
        return self.beta * acc + (1.0 - self.beta) * torch.stack([sq, torch.ones_like(sq)], 1)

    def factors(self, acc: Tensor) -> Tensor:
        """r (n,) from (acc, w) (n, 2) after this step's update."""
        a, w = acc[:, 0], acc[:, 1]
        if self.rule == "rmsprop":  # bias-corrected; w = 0: an untouched class (its r multiplies zeros)
            a = torch.where(w > 0, a / w.clamp(min=1e-300), torch.zeros((), dtype=a.dtype, device=a.device))
        return self.scale * torch.rsqrt(a + self.eps)

    # -- the factored step (exact_step.hidden_grad) ---------------------------------------------
    def scaled(self, plan, state, fwd, GA: Tensor):
        """The update's sparse part scaled by r, Yd diag(r): (G_A r, its Yd V and row sums, the
        shared negatives' block with its ``G_u`` scaled (a new block: its scatter and Gramian read
        it), the classes and their (acc, w)'s change for ``write_acc``). Changes nothing. Static
        shapes (a compiled step)."""
        idx, neg, Hx = fwd.idx, fwd.neg, fwd.Hx
        m, K = idx.shape
        ids = idx.reshape(-1).clamp(min=0)  # padding: a zero row added to class 0's
        on = torch.where(idx >= 0, GA, torch.zeros((), dtype=GA.dtype, device=GA.device))
        rows = (on[:, :, None] * Hx[:, None, :].to(GA.dtype)).reshape(m * K, -1)  # each slot's part of g_c
        real = (idx >= 0).reshape(-1)
        if neg.shared:  # the block's rows of Yd^T H, G_u^T H (its columns past u: zeros)
            ids = torch.cat([ids, neg.uniq])
            rows = torch.cat([rows, neg.G_u.T @ Hx.to(GA.dtype)])
            real = torch.cat([real, torch.ones_like(neg.uniq, dtype=torch.bool)])
        uniq, inv = padded_unique(ids)
        g = torch.zeros_like(rows).index_add_(0, inv, rows)  # each class's row g_c (entries past u: 0)
        sq = (g * g).sum(1)
        # the classes touched (past u: none; class 0 only by padding: none)
        hit = torch.zeros_like(sq).index_add_(0, inv, real.to(sq.dtype)) > 0
        old = state.row_acc.index_select(0, uniq).to(GA.dtype)
        new = self.advanced(old, sq)
        r = self.factors(new).index_select(0, inv)
        row_sq = (uniq, torch.where(hit[:, None], new - old, torch.zeros((), dtype=sq.dtype, device=sq.device)))
        GA = GA * r[:m * K].view(m, K)
        YV, ybar = plan.gather_sum(state.V, idx, GA), GA.sum(1)
        if neg.shared:
            G_u = neg.G_u * r[m * K:]
            YV, ybar, neg = neg.with_gradients(G_u, YV, ybar, G_u.sum(1))
        return GA, YV, ybar, neg, row_sq

    def write_acc(self, state, fwd, ok: Tensor) -> None:
        """(acc, w) moved at the step's classes (``scaled``: the change, 0 off them), kept where the
        device flag ``ok`` is false."""
        uniq, change = fwd.row_sq
        change = torch.where(ok, change, 0.0)
        state.row_acc.index_add_(0, uniq, change.to(state.row_acc.dtype))
