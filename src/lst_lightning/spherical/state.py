"""The factored head's buffers, each declared once: its shape, dtype, initial value (which
is also its value after ``reset_weight()``), whether every rank holds it alike, and
whether it is part of the exact state a step changes.

``FactoredSphericalHead`` registers its buffers from this table (``NaiveSphericalHead``
its two step counters and the preconditioner's moments), ``reset_weight()``
restores them from it, the multi-process code broadcasts and hashes the replicated
ones, and the tests compare heads by the exact ones: a new buffer is one new row here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .stabiliser import REPAIR_COUNTERS

SHAPES = ("rows", "square", "vector", "scalar")
DTYPES = ("state", "float64", "long", "bool")
INITS = ("rows", "eye", "zeros", "ones", "power")


@dataclass(frozen=True)
class Buffer:
    name: str
    #: rows: V's rows held here (row_hi - row_lo) x width; square: width x width; vector: width.
    shape: str
    #: state: the head's dtype (float32 or float64); float64, long, bool: always those.
    dtype: str
    #: rows: the initial W's rows (from the head's seed); eye, zeros, ones; power: a fixed
    #: random start of the power iterations (the same on every device).
    init: str
    #: every rank holds it alike (broadcast by distribute(), hashed by check_replicas()).
    replicated: bool = True
    #: in the state dict; the step's device inputs (lr, the bad-input flag) are not.
    persistent: bool = True
    #: W's factors, their bookkeeping and the carried bound: what a step changes exactly.
    exact: bool = False

    def __post_init__(self):
        if self.shape not in SHAPES or self.dtype not in DTYPES or self.init not in INITS:
            raise ValueError(f"buffer {self.name}: shape, dtype or init unknown: {self}")

    def initial(self, head, device=None) -> Tensor:
        """This buffer's initial value for ``head`` (on ``device``, default the head's)."""
        device = head._factory["device"] if device is None else device
        dtype = {"state": head.dtype, "float64": torch.float64, "long": torch.long, "bool": torch.bool}[self.dtype]
        w = head.width
        if self.init == "rows":
            return head._init_rows(head.row_lo, head.row_hi, device).to(dtype)
        if self.init == "eye":
            return torch.eye(w, dtype=dtype, device=device)
        if self.init == "power":
            g = torch.Generator().manual_seed(0)  # on the host: the same starts on every device
            draws = [torch.randn(w, generator=g, dtype=dtype, device="cpu") for _ in range(POWER_STARTS.index(self.name) + 1)]
            return draws[-1].to(device)
        fill = 1 if self.init == "ones" else 0
        shape = {"square": (w, w), "vector": (w,), "scalar": ()}[self.shape]
        return torch.full(shape, fill, dtype=dtype, device=device)


#: The warm starts of the power iterations for U's largest and smallest singular values, drawn in this order.
POWER_STARTS = ("u_max", "u_min")

STATE: tuple[Buffer, ...] = (
    Buffer("V", "rows", "state", "rows", replicated=False, exact=True),  # replicated unless sharded
    Buffer("U", "square", "state", "eye", exact=True),
    Buffer("Uinv", "square", "state", "eye", exact=True),
    Buffer("omega", "vector", "state", "zeros", exact=True),
    Buffer("Q", "square", "state", "zeros", exact=True),      # W^T W: refresh_bookkeeping() fills it
    Buffer("wbar", "vector", "state", "zeros", exact=True),   # W^T 1: likewise
    Buffer("steps", "scalar", "long", "zeros"),
    Buffer("skipped_nonfinite", "scalar", "long", "zeros"),
    *(Buffer(n, "vector", "state", "power") for n in POWER_STARTS),
    Buffer("_lr_t", "scalar", "state", "zeros", replicated=False, persistent=False),       # lr on the device
    # the first step since the last read of the flags with a bad target id (numbered from 1; 0: none)
    Buffer("_bad_input", "scalar", "long", "zeros", replicated=False, persistent=False),
    # the factor the loss reached a backward with, where not the loss scale (0: none since the read)
    Buffer("_loss_factor", "scalar", "float64", "zeros", replicated=False, persistent=False),
    Buffer("cond_bound", "scalar", "float64", "ones", exact=True),   # >= cond(U), carried from step to step
    # the right preconditioner's running moment of the inputs and its weight (preconditioner.py)
    Buffer("input_moment", "square", "state", "zeros", exact=True),
    Buffer("input_moment_weight", "scalar", "state", "zeros", exact=True),
    Buffer("cond_estimate", "scalar", "float64", "ones"),            # measured at the last check
    *(Buffer(n, "scalar", "long", "zeros") for n in REPAIR_COUNTERS),
)

#: The step counters, which the naive head holds too (every counter is declared here only).
STEP_COUNTERS = tuple(b for b in STATE if b.name in ("steps", "skipped_nonfinite"))
#: The preconditioner's moments, which the naive head holds too.
INPUT_MOMENTS = tuple(b for b in STATE if b.name in ("input_moment", "input_moment_weight"))
#: What every rank holds alike (V too, unless sharded).
REPLICATED_STATE = tuple(b.name for b in STATE if b.replicated)
#: The exact state: equal bits here mean the same W, bookkeeping and conditioning bound.
EXACT_STATE = tuple(b.name for b in STATE if b.exact)


class StepState(NamedTuple):
    """The tensors a step reads and writes: the head's buffers themselves (``driver.step_state``
    gathers them), so that the step (exact_step.py) reads and writes these, never the head; the write
    updates them in place (masked under device flags: a bad batch changes nothing)."""
    V: Tensor
    U: Tensor
    Uinv: Tensor
    omega: Tensor
    Q: Tensor
    wbar: Tensor
    cond_bound: Tensor
    cond_estimate: Tensor
    input_moment: Tensor
    input_moment_weight: Tensor
    folds: Tensor
    #: the step counters (device flags: counted on the device) and the first void step since the flags' last read
    steps: Tensor
    skipped_nonfinite: Tensor
    bad_input: Tensor
    #: the adaptive Neumann rule: the largest bound on rho since the flags' last read (None before the first step)
    rho_max: Tensor | None
    #: the products route's Neumann factors the flags' last read chose
    factors: int
