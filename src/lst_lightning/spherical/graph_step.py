"""The factored head's device step captured in one CUDA graph (``step="cuda_graph"``).

A step is a few hundred small kernels; on a GPU their launch gaps, not their work, decide its time
at moderate m, and a captured graph launches them all at once. The graph holds ``replayed_step``:
exact_step.py's ``device_step`` run by the driver as every device step is (compiled where the plan
says), the same function as the fused step's. It needs a step that reads nothing on the host
(``sync_every > 1``) and fixed shapes: a graph holds a batch size (batch_shapes.py) and takes any
batch of at most its M rows and K slots, checked by the head (``prepare``) outside the graph and
copied in padded. Sampled classes are drawn inside the graph, from a device generator registered
with it (``NegativeSampling.draw_on``): each replay draws anew (per-row negatives for the M rows,
not the draw an unpadded step of m rows would make).
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import driver, exact_step
from .driving import Driving
from .precision import own_math
from .state import STATE


#: what a step at lr 0 may change, put back after it: every buffer but V's rows (a zero step
#: adds exact zeros to them), so the counters, the preconditioner's moments, and U^-1, which the
#: products route refines by Newton-Schulz steps at any lr (d x d: cheap to keep)
SMALL_STATE = tuple(b.name for b in STATE if b.shape != "rows")


@contextlib.contextmanager
def at_zero_lr(head: torch.nn.Module):
    """Steps taken inside run at lr = 0 and leave the head's state as it was, bit for bit:
    V keeps its bits (a zero step adds exact zeros), the rest is put back (``SMALL_STATE``),
    with no flag read or repair meanwhile.
    Uses the head's public API only: its buffers, ``step_checks`` (device flags: ``Driving(
    "cuda_graph", ...)`` needs ``sync_every > 1``), ``sync_every`` and ``pin_device_lr``."""
    kept = {k: head.get_buffer(k).clone() for k in SMALL_STATE}
    draws = None if head.negatives is None else head.negatives.state()  # the steps' draws are undone too
    checks = head.step_checks
    saved = checks.calls, checks.synced, head.sync_every
    head.sync_every = 1 << 62
    head.pin_device_lr(0.0)
    try:
        yield
    finally:
        for k, v in kept.items():
            head.get_buffer(k).copy_(v)
        if draws is not None:
            head.negatives.load_state(draws)
        checks.calls, checks.synced, head.sync_every = saved
        head.pin_device_lr(None)


@torch.no_grad()
def replayed_step(head: torch.nn.Module, Hx: Tensor, idx: Tensor, T: Tensor, rows: Tensor,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """What a graph captures: one device step (``run_device_part``'s ``device_step``) of a static
    batch (``Hx`` augmented, M rows of which ``rows`` are real, a device count), its draw's uniforms
    made on the device inside it. (the loss, dL/dH's columns of H in ``dtype``)."""
    with own_math(Hx.device.type, head.tf32):
        draws = None if head.negatives is None else head.negatives.uniforms(head, Hx.shape[0])
        batch = exact_step.Batch(Hx, idx, T, rows)
        route = exact_step.step_route(head.plan, Hx.shape[0])
        loss, dH, _, _ = driver.run_device_part(head, exact_step.device_step, batch, head.device_lr(), draws, route)
        return loss, dH[:, : head.hidden_dim].to(dtype)


class CudaGraphStep:
    """``step(H, target_idx) -> (loss, dL/dH)``: ``replayed_step`` replayed from a graph, for
    batches of at most ``m`` rows and ``K`` slots (padded to them).

    The lr is read from a device scalar at each replay (a schedule needs no new
    capture); the head's flags are read every ``head.sync_every`` replays. With
    ``Stabiliser.neumann="adaptive"`` a read may change the step's Neumann factors: the
    step is captured once for each number it takes. The returned tensors are the graph's
    own outputs: use them before the next call.
    """

    def __init__(self, head: torch.nn.Module, m: int, K: int = 1, hidden_dtype: torch.dtype | None = None,
                 warmup: int = 3):
        if not head.V.is_cuda:
            raise ValueError("CUDA graphs need the head on a CUDA device")
        Driving("cuda_graph", head.sync_every, head.parallel)  # the rules of capture: sync_every > 1, one process
        self.head, self.m, self.K = head, m, K
        self.dtype = hidden_dtype or head.dtype
        dev = head.device
        self.Hx = torch.zeros(m, head.width, dtype=head.dtype, device=dev)  # H augmented (prepare), padded with 0
        self.idx = torch.full((m, K), -1, dtype=torch.long, device=dev)
        self.T = torch.zeros(m, K, dtype=head.dtype, device=dev)
        self.rows = torch.full((), m, dtype=torch.int64, device=dev)  # the replayed batch's real rows
        if head.negatives is not None:  # sampled classes drawn inside the graph, by a device generator
            head.negatives.draw_on(dev)
        self.warmup = warmup
        #: one graph per number of Neumann factors the step took when it was captured
        #: (``Stabiliser.neumann="adaptive"`` changes it at a read of the flags): (graph, loss, dH)
        self.graphs: dict[int, tuple] = {}
        self._capture()

    def _step(self) -> tuple[Tensor, Tensor]:
        return replayed_step(self.head, self.Hx, self.idx, self.T, self.rows, self.dtype)

    def _capture(self) -> tuple:
        """Capture the step as it runs now (its factors: ``head.step_checks.factors``)."""
        head = self.head
        driver.before_step(head, self.m, draw=False)  # U^-1 refreshed where due, outside the graph
        self._warm_up(self.warmup)
        graph = torch.cuda.CUDAGraph()
        if head.negatives is not None:  # each replay draws anew, from the generator's state then
            graph.register_generator_state(head.negatives.device_generator)
        with torch.cuda.graph(graph):
            loss, dH = self._step()
        self.graphs[head.step_checks.factors] = captured = (graph, loss, dH)
        return captured

    @torch.no_grad()
    def _warm_up(self, n: int) -> None:
        """Run the step on a side stream before capture (lazy initialisation of cuBLAS and
        of Triton's compiled kernels), at lr = 0 so that the head keeps its state."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), at_zero_lr(self.head):
            for _ in range(n):
                self._step()
        torch.cuda.current_stream().wait_stream(side)

    @torch.no_grad()
    def __call__(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> tuple[Tensor, Tensor]:
        idx = target_idx[:, None] if target_idx.dim() == 1 else target_idx
        (m, k), width = idx.shape, self.head.hidden_dim
        if H.dim() != 2 or H.shape[1] != width or H.shape[0] != m or not 1 <= m <= self.m or k > self.K:
            raise ValueError(f"this graph was captured for at most {self.m} rows of H (m, {width}) and "
                             f"{self.K} target slots, got H {tuple(H.shape)} and targets {tuple(idx.shape)}")
        head = self.head
        head.check_decay()  # the captured step checked it once, at capture
        Hx, idx, T = head.prepare(H, idx, None if target_val is None else target_val.reshape(idx.shape), step=True)
        self.Hx[:m].copy_(Hx)
        self.Hx[m:].zero_()
        self.idx.fill_(-1)
        self.idx[:m, :k].copy_(idx)
        self.T.zero_()
        self.T[:m, :k].copy_(T)
        self.rows.fill_(m)
        head.device_lr()  # refill lr outside the graph
        graph, loss, dH = self.graphs.get(head.step_checks.factors) or self._capture()
        graph.replay()
        head.count_replay()  # counted on the host: the flags read every sync_every replays
        return loss, dH[:m]
