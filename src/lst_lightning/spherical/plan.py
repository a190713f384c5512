"""The plan of the factored head's step: every mode settled once, and every refusal.

``StepPlan`` (``head.plan``) is made again by the head's ``_replan`` whenever a setting, the
device or the process group changes. It holds every mode of the step (its fields) and, chosen
once from them, the function of each choice (exact_step.py's): the step calls what its plan
holds and asks the head's settings for none of it. The refusals of combinations of settings are
here too, each one line saying why: ``driving_refusal``, ``compile_refusal`` (what keeps the
step's device part from compiling whole), ``head_refusal`` (the head's parts with the driving),
``accumulate_refusal`` (exact accumulation).
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field
from functools import partial

import torch

import lst_kernels as lk

from . import exact_step, negatives
from .stabiliser import Stabiliser


@dataclass(frozen=True)
class StepPlan:
    #: the driver: "autograd" (the update in ``loss.backward()``), "fused", "cuda_graph"
    step: str = "autograd"
    #: ``sync_every > 1``: a training step reads nothing on the host (bad ids void it, raised at the
    #: flags' read); else (``sync_every == 1``, and the naive head) the target ids are checked on the host
    #: before the step, raised before anything changes, and several processes gather their exact rows.
    #: The device part is the same either way; the flags are read after every step with ``sync_every == 1``
    deferred: bool = True
    #: the device part compiled whole (driver.py)
    compiled: bool = False
    #: "none" (one process: the step never calls ``head.processes``), "replicated", "sharded"
    processes: str = "none"
    #: the sampled classes (negatives.py): None (off), "shared" (one dense block) or "per_row" (slots of
    #: each row)
    negatives: str | None = None
    #: the right preconditioner's settings (preconditioner.py: its moments, P), None: off
    preconditioner: object = None
    #: how H U_new^-1 is made past ``woodbury_rows`` rows: "solve" or "products" (or "woodbury")
    inverse: str = "solve"
    #: the most rows a step makes H U_new^-1 for by the Woodbury update (-1: never)
    woodbury_rows: int = -1
    #: the most rows a step updates Q for through the m x m M (``m_matrix_rows``); more: from d x d products
    m_matrix_rows: int = 0
    #: the products route's Neumann factors: "adaptive" or "max" (stabiliser.py)
    neumann: str = Stabiliser.neumann
    #: D, the classes, and d, the head's width (its hidden size, one more with a bias)
    num_classes: int = 1
    width: int = 1
    #: a step is folded into V where the bounds cannot rule out an eigenvalue of B / c within ``fold_tol``
    #: of 0, or where cond(U)'s bound would pass ``fold_cond`` (the ``Stabiliser``'s)
    fold_tol: float = Stabiliser.fold_tol
    fold_cond: float = Stabiliser.fold_cond
    #: the head's ``Processes`` (multi_process.py), whose collectives a step of several processes calls
    collectives: object = field(default=None, compare=False)
    #: the head's weight decay (W <- c W - ..., c = 1 - lr weight_decay)
    weight_decay: float = 0.0
    #: the bound on the norm of the step's gradient of W (times P), None: none (base.py's ``clip_norm``)
    clip_norm: float | None = None
    #: the head's loss (``losses``) and its reduction over the rows (base.py's ``REDUCTIONS``)
    loss: object = field(default=None, compare=False)
    reduction: str = "mean"
    #: the head's ``NegativeSampling`` (negatives.py: its proposal and the draw), None without sampled classes
    sampling: object = field(default=None, compare=False)
    #: the kernel ops' implementation (``lst_kernels.ops_for`` of the head's device when the plan is made:
    #: Triton on CUDA where importable and the environment's ``LST_KERNELS`` is not "torch", else torch),
    #: which the step calls unchecked (``plan.kernels.m_matrix(...)``): no op re-checks or re-chooses
    kernels: lk.Ops = lk.ops_for("cpu")
    #: the type of the head's device ("cpu", "cuda", ...)
    device: str = "cpu"

    # -- the functions the step calls for these modes, chosen once (``__post_init__``) -----------
    #: the screen of bad ids for these processes (one, or several exchanging their rows)
    screen: object = field(init=False, compare=False, repr=False)
    #: d reduce / d per of the ``reduction`` (``exact_step.ROW_WEIGHTS``: sum, mean_real or mean's)
    row_weights: object = field(init=False, compare=False, repr=False)
    #: the U^-1 route of a step of at most ``woodbury_rows`` rows (Woodbury) and of more (``inverse``)
    few_rows: exact_step.Route = field(init=False, compare=False, repr=False)
    many_rows: exact_step.Route = field(init=False, compare=False, repr=False)
    #: the sampled classes' mode (``sampling.mode``: negatives.py's ``SharedDraw`` or ``PerRowDraw``), or
    #: exact_step.py's ``TARGETS_ONLY``
    slots: object = field(init=False, compare=False, repr=False)
    #: the gathers and the scatter of V's rows: ``kernels``' with V whole, else the ``ShardedRows``' (bound to them);
    #: ``rows_of(V, ids)``, V's rows of the classes ``ids``: indexing with V whole, else ``ShardedRows.rows_of``
    rows_of: object = field(init=False, compare=False, repr=False)
    gather_dot: object = field(init=False, compare=False, repr=False)
    gather_sum: object = field(init=False, compare=False, repr=False)
    scatter_rows: object = field(init=False, compare=False, repr=False)
    #: ``index_add_rows(V, 0, ids, rows)``: V[ids] += rows, ``Tensor.index_add_`` with V whole (negatives.py's
    #: ``add_rows_``), else into the rows this rank holds (negatives.py's ``add_own_rows_``): a shared block's scatter
    index_add_rows: object = field(init=False, compare=False, repr=False)
    #: ``index_add_in_order(out, 0, ids, rows)``: the same, summed in the order of ids: ``Tensor.index_add_``
    #: on the CPU (``add_rows_``), which adds in that order; on CUDA, whose ``index_add_`` adds by float atomics, the
    #: deterministic scatter (negatives.py's ``add_in_order_``): a shared block's repeated columns
    index_add_in_order: object = field(init=False, compare=False, repr=False)
    #: the step's write, masked by its flags: ``exact_step.write_with_parts`` where the plan has a part that writes
    #: its own (a shared block, P), else ``exact_step.write``
    write: object = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        sh, alone, routes = self.collectives, self.processes == "none", exact_step.ROUTES
        whole = self.processes != "sharded"  # V's rows all here
        parts = self.negatives == "shared" or self.preconditioner is not None
        chosen = dict(screen=exact_step.screen if alone else exact_step.screen_exchanged,
                      row_weights=exact_step.ROW_WEIGHTS[self.reduction],
                      few_rows=routes["woodbury"], many_rows=routes[self.inverse],
                      slots=exact_step.TARGETS_ONLY if self.sampling is None else self.sampling.mode,
                      rows_of=operator.getitem if whole else sh.rows_of,
                      gather_dot=self.kernels.gather_dot if whole else partial(sh.gather_dot, self.kernels),
                      gather_sum=self.kernels.gather_sum if whole else partial(sh.gather_sum, self.kernels),
                      scatter_rows=self.kernels.scatter_add_rows_ if whole else partial(sh.scatter_rows, self.kernels),
                      index_add_rows=negatives.add_rows_ if whole else partial(negatives.add_own_rows_, sh),
                      index_add_in_order=(partial(negatives.add_in_order_, self.kernels) if self.device == "cuda"
                                          else negatives.add_rows_),
                      write=exact_step.write_with_parts if parts else exact_step.write)
        for name, value in chosen.items():
            object.__setattr__(self, name, value)


def m_matrix_rows(d: int) -> int:
    """The most rows m whose Q update goes through the m x m M (3 m^2 d + m d^2 multiply-adds)
    rather than from d x d products (``q_update_factors`` with H^T diag(g_q) H given, which the
    step forms for B: 2 m d^2 + 2 d^3): 3 m^2 + m d <= 2 m d + 2 d^2, (3 m + 2 d)(m - d) <= 0,
    m <= d."""
    return d


def inverse_rows(route: str, device: torch.device, d: int) -> tuple[str, int]:
    """(the U^-1 route past the Woodbury rows, the Woodbury rows) for ``Stabiliser.inverse``.
    "auto": on a GPU the products (both others factorise, latency-bound there); on a CPU
    Woodbury (m^2 d + m^3) where 2 m <= d, else a fresh solve with U_new (d^3 + m d^2): their
    measured crossover."""
    if route == "auto":
        return ("products", -1) if device.type == "cuda" else ("solve", d // 2)
    return route, sys.maxsize if route == "woodbury" else -1


def negatives_kind(negatives) -> str | None:
    """The kind of sampled classes of a head's ``NegativeSampling`` (None: off; ``StepPlan.negatives``)."""
    return None if negatives is None else "shared" if negatives.settings.shared else "per_row"


def plan_for(head) -> StepPlan:
    """The plan of ``head``'s step from its settings, its device and its process group (and the
    kernel ops' implementation for that device, ``LST_KERNELS`` read here)."""
    driving = head.driving
    kind = negatives_kind(head.negatives)
    settings = head.repairs.settings
    inverse, woodbury_rows = inverse_rows(settings.inverse, head.device, head.width)
    compiled = compiles_on(driving, head.device)
    return StepPlan(step=driving.step, deferred=driving.sync_every > 1, compiled=compiled,
                    processes="none" if head.processes.alone else head.processes.parallel, negatives=kind,
                    preconditioner=head.preconditioner, inverse=inverse, woodbury_rows=woodbury_rows,
                    m_matrix_rows=m_matrix_rows(head.width), neumann=settings.neumann,
                    num_classes=head.num_classes, width=head.width, fold_tol=settings.fold_tol,
                    fold_cond=settings.fold_cond, collectives=head.processes, loss=head.loss_fn,
                    reduction=head.reduction, sampling=head.negatives, weight_decay=head.weight_decay,
                    clip_norm=head.clip_norm, kernels=lk.ops_for(head.device), device=head.device.type)


# -- the refusals, each one line saying why ----------------------------------------------------
def driving_refusal(driving) -> str | None:
    """Why the driving settings (step, sync_every, parallel) cannot go together, or None."""
    if driving.step == "cuda_graph" and driving.sync_every == 1:
        return ("step='cuda_graph' replays a step that reads nothing on the host: it needs sync_every > 1 "
                "(the device flags read every sync_every steps), got sync_every=1")
    if driving.step == "cuda_graph" and driving.parallel != "none":
        return (f"step='cuda_graph' with parallel={driving.parallel!r}: a multi-process head exchanges data "
                "between ranks each step, which is not captured; use step='fused'")
    return None


def compiles_on(driving, device: torch.device) -> bool:
    """Whether a head driven so runs its step's device part compiled on ``device``: ``compile``
    True, or "auto" on a CUDA device, and nothing refusing it."""
    wanted = driving.compile is True or (driving.compile == "auto" and device.type == "cuda")
    return wanted and compile_refusal(driving) is None


def compile_refusal(driving) -> str | None:
    """Why the step's device part cannot be compiled whole, or None. ``sync_every=1`` compiles the
    same device part: its host checks come before the step, and its flags are read after it."""
    if driving.parallel == "sharded":
        return "parallel='sharded' all-reduces between the step's parts"
    return None


def head_refusal(driving) -> str | None:
    """Why the factored head cannot be driven so, or None."""
    if driving.compile is True:
        why = compile_refusal(driving)
        if why is not None:
            return f"compile_step=True: this head's step cannot be compiled whole: {why}"
    return None


def accumulate_refusal(driving) -> str | None:
    """Why a head driven so cannot wait for the optimizer's step (exact accumulation over
    micro-batches, a loss scaler's unscaled step), or None when it can."""
    if driving.step != "autograd":
        return f"step={driving.step!r} steps in the forward (use step='autograd')"
    return None
