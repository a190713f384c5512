"""The host's part of the factored step, the only part of the step that takes the head: the
driver of exact_step.py's device part (``device_step``; its halves ``forward`` and ``update`` for
the autograd step; ``records_step`` for exact accumulation). Before it, ``before_step``: what only
the host can do; around it, ``run_device_part``: the version, the device part compiled whole
(``run``; docs/factored_head.md, "The compiled step") or eager, the flags ticked and read.

The checks are device flags (``DeviceFlags``, ``head.step_checks``): every check a flag masking
the write (a bad step changes nothing and is counted), read by ``head.sync()`` in one host
transfer every ``sync_every`` steps, with the training loop's flags on ``head.flag_board``, and
the repairs that fell due. Every ``sync_every`` runs the same device part: the fold decided by
the bounds of B's eigenvalues (``device_bounds``), the products route's Neumann factors those the
flags' last read chose, shared negatives coalesced in static shapes. With ``sync_every > 1`` the
step reads nothing on the host (a CUDA graph can capture it; bad target ids void the step, raised at
the next read); with ``sync_every == 1`` the flags are read after every step, and bad ids raise
before anything changes (the head's input check, which the naive head makes too).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import operator

import torch
from torch import Tensor

from ..heads.user_warning import warn
from .batch_shapes import batch_size, pad_batch, pad_draws, pad_rows, real_rows
from .exact_step import Batch, Route, SavedForward, device_step, forward, records_step, step_route, update
from .inverse_update import MAX_FACTORS, adaptive_factors
from .precision import own_math
from .state import StepState

#: Dynamo's limit of graphs per compiled function while the step runs, past one graph for each
#: key it has met (``graph_key``: a batch size of m and K, batch_shapes.py, a number of Neumann
#: factors): the room for graphs no key explains
RECOMPILE_LIMIT = 8

_compiled: dict = {}
_keys: dict = {}  # the keys each compiled function met (graph_key)


def graph_key(plan, state: StepState, args) -> tuple:
    """What a device part's graph is specialised on that a run changes: the plan (by identity; a new
    one at every change of the head's buffers' shapes), the state's Neumann factors, and from the
    other arguments (and the fields of those that are tuples or dataclasses, one level down) each
    tensor's shape, each int and str (the route's name), each other value's type."""
    key = [id(plan), state.factors]
    for a in args:
        parts = a if isinstance(a, tuple) else vars(a).values() if dataclasses.is_dataclass(a) else (a,)
        key.extend(tuple(p.shape) if isinstance(p, Tensor) else p if isinstance(p, (int, str)) else type(p)
                   for p in parts)
    return tuple(key)


def compiled(fn):
    """``fn`` compiled whole, once per function: ``fullgraph`` (a graph break raises), static
    shapes, without autograd. The function itself is compiled, not its ``torch.no_grad()``
    wrapper, whose one code object every wrapped function shares (and with it Dynamo's cache
    and its limit of recompiles)."""
    out = _compiled.get(fn)
    if out is None:
        out = _compiled[fn] = torch.no_grad()(torch.compile(inspect.unwrap(fn), fullgraph=True, dynamic=False))
    return out


def run(plan, fn, *args):
    """``fn(*args)``, one of exact_step.py's device parts (a function of the plan and tensors):
    compiled where the plan says, with Dynamo's limit of graphs per function at one per key met
    (``graph_key``: however many batch sizes and Neumann factors a run meets, none stops it) and
    ``RECOMPILE_LIMIT`` more."""
    if not plan.compiled:
        return fn(*args)
    step = compiled(fn)
    keys = _keys.setdefault(step, set())
    keys.add(graph_key(plan, args[1], args[2:]))
    limit = len(keys) + RECOMPILE_LIMIT
    with torch._dynamo.config.patch(recompile_limit=limit,
                                    accumulated_recompile_limit=max(limit, torch._dynamo.config.accumulated_recompile_limit)):
        return step(*args)


# -- the checks: device flags, read every sync_every steps ------------------------------------
class DeviceFlags:
    """The step's checks as device flags, read every ``sync_every`` steps (1: after every step)."""

    def __init__(self):
        self.calls = 0           # training steps run (host count)
        self.synced = (0, 0)     # (steps, skipped) at the last read
        self.lr_filled = None    # the lr held in the device scalar head._lr_t
        self.pinned = False      # pin_lr(): the device lr holds a value of its own
        #: the products route's Neumann factors a step (Stabiliser.neumann: "max" keeps them there)
        self.factors = MAX_FACTORS
        #: the largest rho bound of the steps since the last read, on the device ("adaptive" reads it)
        self.rho_max: Tensor | None = None
        self.read_at = -1  # the steps run (``calls``) at the last read
        self.warned_skipped = 0  # the skipped steps warned about
        #: several processes: the void step the last read found, (its rank, why: None for bad
        #: ids in that rank's rows; padded_rows.py)
        self.fault: tuple[int, str | None] | None = None
        #: the head's ``stats()`` as the last read took them ({}: no read yet): ``logged_stats()``
        self.stats: dict[str, float] = {}

    def refill(self, head) -> None:
        """The flags' part before a step (``before_step``): lr refilled into the device scalar ``head._lr_t``
        (outside any graph capture) when it changed, which the step reads (a captured graph
        and a compiled step at each call: no recompile for a new lr); the adaptive rule's rho
        bound's board made once."""
        lr = head._lr
        capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()  # (no NVML load)
        if not self.pinned and self.lr_filled != lr and not capturing:
            head._lr_t.fill_(lr)
            self.lr_filled = lr
        if self.rho_max is None:
            self.rho_max = torch.zeros((), dtype=head.cond_bound.dtype, device=head.device)

    def lr(self, head) -> Tensor:
        """lr as the device scalar the step reads, refilled when lr changed (``refill``)."""
        self.refill(head)
        return head._lr_t

    def pin_lr(self, head, value: float | None) -> None:
        """Hold the device lr at ``value`` whatever ``head.lr`` (None: follow ``head.lr`` again)."""
        self.pinned = value is not None
        self.lr_filled = None
        if value is not None:
            head._lr_t.fill_(value)

    def tick(self, head) -> bool:
        """One more step run (on the host, after its device part); whether the flags are due to
        be read (every ``sync_every``). A step being captured is counted by its replays
        (``head.count_replay``), not here."""
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            return False
        self.calls += 1
        return self.calls % head.driving.sync_every == 0

    def read(self, head, peek: bool = False):
        """Read the flags in one host transfer (the steps taken and skipped, the step of a bad
        batch, cond(U)'s bound, a loss factor, the adaptive rule's rho bound; several processes:
        the void step's rank) with the parties' on ``head.flag_board`` (the training loop's: each
        raises for its fault first), and warn about skipped steps and a loss that reached the head
        multiplied. (steps at the last read, steps now, cond(U)'s bound, the step of a bad batch
        or 0), or None when no step ran since the last read (the parties' flags alone are read
        then). ``peek``: the read changes nothing the steps depend on (the read's place in the run,
        the Neumann factors): the next read takes the same window of steps, and its repairs, as
        without it."""
        if self.calls == self.read_at:
            head.flag_board.read()
            return None
        if not peek:
            self.read_at = self.calls
        stats = [getattr(head, n) for n in head.STATS]  # the head's stats() ride on the same transfer
        flags = stats + [head._bad_input, head._loss_factor]
        if self.rho_max is not None:
            flags.append(self.rho_max)
        padded = head.processes.padded if head.processes.padded.capacity is not None else None
        ranks = [] if padded is None else padded.flags()  # several processes: the void step's fault
        values = head.flag_board.read(flags + ranks)
        self.stats = head.stats_of(values[:len(stats)])
        bad, factor, *rho_max = values[len(stats):len(flags)]
        steps, skipped, cond_bound, bad = self.stats["steps"], self.stats["skipped_nonfinite"], \
            self.stats["cond_bound"], int(bad)
        if padded is not None:  # every rank reads at the same step: a void rank's message is gathered here
            self.fault = padded.read(values[len(flags):] if bad else None)
        if factor:
            head._warn_loss_factor(factor)
            head._loss_factor.zero_()
        n_prev, skipped_prev = self.synced
        warned = max(skipped_prev, self.warned_skipped)
        if any(k & (k - 1) == 0 for k in range(warned + 1, skipped + 1)):
            warn(f"{type(head).__name__}: {skipped - warned} step(s) with non-finite or invalid values since the "
                 f"last check were skipped, the head's state left untouched ({skipped} skipped so far)", RuntimeWarning)
        self.warned_skipped = skipped
        if not peek:
            self.synced = (steps, skipped)
            self.adapt_factors(head, skipped > skipped_prev, rho_max[0] if rho_max else None, cond_bound)
        return n_prev, steps, cond_bound, bad

    def adapt_factors(self, head, skipped: bool, rho_max: float | None, cond_bound: float) -> None:
        """``Stabiliser.neumann="adaptive"``: the factors of the steps up to the next read, from
        the largest rho bound since the last (then reset); the maximum after a skipped step."""
        if head.plan.neumann != "adaptive":
            self.factors = MAX_FACTORS
            return
        if rho_max is None:  # no step yet
            return
        self.factors = adaptive_factors(rho_max, cond_bound, head.repairs.settings.cond_trigger, skipped, head.dtype)
        self.rho_max.zero_()

    def raise_bad_input(self, head, step: int) -> None:
        """Raise for the void step ``step`` (as the read found it), in one line: its bad target
        ids; several processes: the rank whose rows held them, or the rank whose input failed
        and its message (``self.fault``, from the read)."""
        head._bad_input.zero_()
        fault, self.fault = self.fault, None
        where = "" if fault is None else f" in rank {fault[0]}'s rows"
        padding = "-1" if head.ignore_index == -1 else f"-1 or ignore_index ({head.ignore_index})"
        what = (f"had target ids outside [0, {head.num_classes}){where} (class ids, or {padding} for padding)"
                if fault is None or fault[1] is None else f"was void on every rank: rank {fault[0]}'s input {fault[1]}")
        raise ValueError(f"{type(head).__name__}: the batch of step {step} {what}; that step was skipped and left "
                         f"the head's state untouched (device flags are read every sync_every={head.sync_every} "
                         "steps; sync_every=1 checks each batch as it comes)")


# -- the host's part: the driver of the device step ------------------------------------------------
def step_state(head) -> StepState:
    """The head's buffers that a step reads and writes, gathered (state.py's ``StepState``)."""
    checks = head.step_checks
    return StepState(head.V, head.U, head.Uinv, head.omega, head.Q, head.wbar, head.cond_bound, head.cond_estimate,
                     head.input_moment, head.input_moment_weight, head.folds, head.steps, head.skipped_nonfinite,
                     head._bad_input, checks.rho_max, checks.factors)


def before_step(head, m: int, rows: int | None = None, draw: bool = True) -> tuple[Tensor | None, Route]:
    """What a step of m rows needs from the host, done before its device part (which a compiled
    step runs whole) on ``rows`` rows (m, or the batch size a compiled step pads them to): the U^-1
    route of those rows (``step_route``), U^-1 refreshed where that route keeps it and the last
    steps left it behind, the device lr refilled (device flags), and with ``draw`` the uniforms of
    the m rows' draw of sampled classes (a compiled graph cannot take a ``torch.Generator``),
    padded to ``rows``. Reads nothing on the device. (the uniforms or None, the route)"""
    plan, rows = head.plan, m if rows is None else rows
    route = step_route(plan, rows)
    if route.keeps_uinv and not head._uinv_fresh:
        head.repairs.refresh_uinv(head)  # the last steps solved with U directly and left U^-1 behind
    head.step_checks.refill(head)
    draws = None if head.negatives is None or not draw else head.negatives.uniforms(head, m)
    return (draws if rows == m else pad_draws(head, draws, m, rows)), route


def run_device_part(head, fn, *args):
    """``fn(plan, state, *args)``, a device part (``device_step``, ``update``, ``records_step``), as
    the plan says (``run``), after the version moved (a pending backward of an earlier forward is
    stale from here); after it, U^-1 marked stale where the step solved with U_new, the step ticked,
    and every ``sync_every`` steps the flags read and the repairs due run (``head.sync()``)."""
    head._version += 1
    plan = head.plan
    out = run(plan, fn, plan, step_state(head), *args)
    flags = out[-1]
    if not flags.uinv:  # the step solved with U_new: U^-1 left behind
        head._uinv_fresh = False
    if head.step_checks.tick(head):
        head.sync()
    return out


@torch.no_grad()
def forward_step(head, Hx: Tensor, idx: Tensor, T: Tensor) -> tuple[Tensor, SavedForward]:
    """A training forward (the autograd step's): ``before_step``, then ``forward`` (compiled
    where the head's step is: ``run``). Compiled, the batch is padded to a batch size: the caller
    keeps its own m rows of what the step hands back (``_HeadLoss``'s ``ctx.m``)."""
    m, plan = Hx.shape[0], head.plan
    size = batch_size(head, m, idx.shape[1]) if plan.compiled else None  # static shapes: padded
    draws, route = before_step(head, m, None if size is None else size[0])
    if size is None:
        batch = Batch(Hx, idx, T, head.processes.rows, head.processes.exchange)
    else:
        batch = Batch(*pad_batch(Hx, idx, T, *size), real_rows(Hx, m))
    return run(plan, forward, plan, step_state(head), batch, draws, route)


@torch.no_grad()
def backward(head, fwd: SavedForward, grad: Tensor | None) -> Tensor:
    """The autograd step's second half: dL/dH, and ``update``, its write masked by its checks, by
    ``run_device_part`` (the flags read, and the repairs due run, every ``sync_every`` steps).
    (dL/dH of the forward's rows, padding rows too: ``autograd_backward`` keeps the batch's own.)"""
    dH, _ = run_device_part(head, update, fwd, grad, head._lr_t)
    return dH


def autograd_backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None, None, None]:
    """The backward of a training forward through autograd (base.py's ``_HeadLoss.backward``, both
    heads): dL/dH of the rows H came with (and nothing for ``_HeadLoss.forward``'s other inputs), and the head's step with this very forward's gradients
    (``head._backward_step``), or its rows kept for the optimizer's step when attached
    (``head.pending``). A frozen head (eval mode: no token) hands dL/dH on and takes no step; a
    second backward through the same forward hands on the first one's dL/dH; a backward after the
    state moved is refused. A loss that reached the head multiplied by a factor other than the loss
    scale is warned about once, at the flags' next read (the naive head: at once)."""
    head, token = ctx.head, ctx.token
    name = type(head).__name__
    with own_math(grad_out.device.type, head.tf32):
        grad = grad_out.to(head._factory["dtype"])
        if token is None:  # eval mode: a frozen head
            head._warn_once("eval", f"{name} is in eval mode: its loss gives the body dL/dH but the head "
                                    "takes no step (call .train() on it to train it)")
            dH = head._hidden_grad(ctx.saved, grad)
        elif token.dH is not None:  # the same forward's second backward
            head._warn_once("again", f"{name}: a second backward through the same forward (autograd.grad for "
                                     "a gradient norm, retain_graph=True?) hands on the same dL/dH; the head "
                                     "took its step at the first backward and takes no other")
            dH = token.dH * (grad / token.grad) if bool(token.grad != 0) else torch.zeros_like(token.dH)
        else:
            if head._version != ctx.version:
                raise RuntimeError(
                    f"{name}: its state changed between this forward and its backward "
                    "(another step, a repair or a reset ran in between). The head applies its SGD step "
                    "in backward, so each forward must be followed by its own backward.")
            pending = head.pending
            if pending.hook is not None:  # attached: the rows wait for the optimizer's step
                dH = pending.keep(head, ctx.saved, grad, ctx.m)
            else:
                scale = pending.loss_scale
                factor = getattr(head, "_loss_factor", None)  # the factored head's: warned at the flags' read
                if grad.numel() == 1 and "weight" not in head._warned and factor is not None:
                    factor.copy_(torch.where(grad != scale, grad.to(torch.float64) / scale, factor))
                elif grad.numel() == 1 and "weight" not in head._warned and float(grad) != scale:
                    head._warn_loss_factor(float(grad) / scale)  # the naive head's: at once
                dH = head._backward_step(ctx.saved, grad / scale)
                if scale != 1.0:
                    dH = dH * scale
            token.dH, token.grad = dH, grad
            ctx.saved = None  # a second backward reuses the token's dL/dH
    dH = dH[:ctx.m]
    if ctx.rows is not None:
        dH = head.processes.own_rows(dH, ctx.rows)
    return dH[:, : head.hidden_dim].to(ctx.in_dtype), None, None, None, None, None


@torch.no_grad()
def whole_step(head, H: Tensor, Hx: Tensor, idx: Tensor, T: Tensor,
               real: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Forward, backward and update on checked inputs (``Hx``: H augmented): the loss and dL/dH.
    ``real``: where the caller padded the batch itself (a CUDA graph's static batch), its real rows
    as a device count."""
    sh, own = head.processes, None
    if not sh.alone:
        Hx, idx, T, own = sh.collect(Hx, idx, T, training=True)
    m = Hx.shape[0]
    size = batch_size(head, m, idx.shape[1]) if real is None and head.plan.compiled else None
    draws, route = before_step(head, m, None if size is None else size[0])
    if size is not None:
        Hx, idx, T = pad_batch(Hx, idx, T, *size)
        real = real_rows(Hx, m)
    batch = Batch(Hx, idx, T, sh.rows, sh.exchange) if real is None else Batch(Hx, idx, T, real)
    loss, dH, _, _ = run_device_part(head, device_step, batch, head._lr_t, draws, route)
    dH = dH[:m]
    if own is not None:
        dH = sh.own_rows(dH, own)
    return loss, dH[:, : head.hidden_dim].to(H.dtype)


# -- exact accumulation: the micro-batches' records, one step on their union ----------------------
def pending_record(head, fwd: SavedForward, weight: Tensor, n: int):
    """What one micro-batch of ``n`` rows keeps for the optimizer's step (a padded batch: its own
    rows only): its rows and loss gradients, and its shared negatives' draw and gradients (None
    without them; negatives per row are slots of idx)."""
    block = None if not fwd.neg.shared else (fwd.neg.cols, fwd.neg.G_neg[:n] * weight)
    real = None if fwd.real is None else fwd.real[:n]
    return (fwd.Hx[:n], fwd.idx[:n], fwd.gq[:n] * weight, fwd.gs[:n] * weight, fwd.GA[:n] * weight, real,
            fwd.input_ok, block)


@torch.no_grad()
def apply_records(head, records: list) -> None:
    """The step on the union of the micro-batches: their rows, targets padded to one K."""
    K = max(r[1].shape[1] for r in records)
    pad = torch.nn.functional.pad
    Hx = torch.cat([r[0] for r in records])
    idx = torch.cat([pad(r[1], (0, K - r[1].shape[1]), value=-1) for r in records])
    gq, gs = torch.cat([r[2] for r in records]), torch.cat([r[3] for r in records])
    GA = torch.cat([pad(r[4], (0, K - r[4].shape[1]), value=0.0) for r in records])
    real = None if records[0][5] is None else torch.cat([r[5] for r in records])
    input_ok = functools.reduce(operator.and_, [r[6] for r in records])  # device flags: a bad micro-batch voids the step
    blocks = [r[7] for r in records if r[7] is not None]  # shared negatives: each micro-batch's own draw
    cols = torch.cat([c for c, _ in blocks]) if blocks else None
    G_neg = torch.block_diag(*[g for _, g in blocks]) if blocks else None
    size = batch_size(head, Hx.shape[0], idx.shape[1]) if head.plan.compiled else None
    _, route = before_step(head, Hx.shape[0], None if size is None else size[0], draw=False)  # the records carry their draws
    if size is not None:  # padding rows: H 0, ids -1, loss gradients 0
        M = size[0]
        Hx, idx, GA = pad_batch(Hx, idx, GA, *size)
        gq, gs = pad_rows(gq, M), pad_rows(gs, M)
        real = None if real is None else pad_rows(real, M, False)
        G_neg = None if G_neg is None else pad_rows(G_neg, M)
    run_device_part(head, records_step, Hx, idx, gq, gs, GA, real, input_ok, cols, G_neg, head._lr_t, route)
