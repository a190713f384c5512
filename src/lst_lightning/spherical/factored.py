"""The exact factored spherical head (Vincent, de Brebisson & Bouthillier): the D x d output
matrix kept as ``W = V U + 1 omega^T``, never formed. A minibatch costs O(m d^2 + m K d): the loss
reads W only through ``Q = W^T W``, ``wbar = W^T 1`` and the K target rows of V, and the exact SGD
step ``W <- (1 - lr wd) W - lr dO^T H`` is a d x d update of U plus a sparse update of the target
rows of V (docs/algorithm.md, with the code's names; H is m x d).

The step is exact_step.py, driven by driver.py; this file is the head around it: its buffers
(state.py), the implicit W, the ways to drive the step (``self.driving``), ``sync()``, the
repairs' entry (``run_due``) and the multi-process setup. It holds its parts and calls them:
``step_checks`` (driver.py), ``repairs`` (stabiliser.py), ``processes`` (multi_process.py),
``pending`` (pending.py, through base.py); sharded evaluation is a mixin (sharded_eval.py).
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import Tensor

from ..distributed.collectives import ProcessGroup, bit_hash
from ..heads.flag_board import FlagBoard
from ..heads.targets import class_range
from . import driver, exact_step
from .base import SphericalHeadBase, _AppliedLoss, without_placeholder_extra_state
from .batch_shapes import padded_rows, padded_slots
from .blocks import row_blocks, weight_of
from .driver import DeviceFlags
from .driving import BATCH_SIZES, PARALLEL_MODES, STEP_MODES, SYNC_EVERY, Driving
from .graph_step import CudaGraphStep
from .multi_process import processes_for
from .plan import StepPlan, compiles_on, head_refusal, plan_for
from .precision import own_precision
from .settings import Driven
from .shard_files import load_rows
from .sharded_eval import ShardedEvaluation
from .stabiliser import REPAIR_COUNTERS, Repairs, Stabiliser, fell_due
from .state import REPLICATED_STATE, STATE

#: the rows [lo, hi) a state's V holds when it is one rank's shard: in the extra state, or a
#: tensor under this key for savers of tensors only (a patched HF model's)
V_ROWS = "v_rows"


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
    parallel_modes = tuple(p for p in PARALLEL_MODES if p != "none")  # the modes of more than one process
    OPTIONAL_KEYS = (V_ROWS,)  # a shard's rows, where a saver of tensors only records them so

    # the step's host driver (driver.py, around exact_step.py's device step), named as its methods
    _forward_step = driver.forward_step
    _backward_step = driver.backward
    _pending_record = driver.pending_record
    _apply_records = driver.apply_records

    def __init__(self, num_classes: int, hidden_dim: int, *args, init_std: float | None = None,
                 generator: torch.Generator | None = None, stabiliser: Stabiliser | dict | None = None,
                 parallel: str = "none", checksum_every: int = 100, sync_every: int = SYNC_EVERY,
                 step: str = "autograd", compile_step: bool | str = "auto",
                 batch_sizes: str | tuple[int, ...] = BATCH_SIZES, **kwargs):
        super().__init__(num_classes, hidden_dim, *args, init_std=init_std, generator=generator, **kwargs)
        self.repairs = Repairs(Stabiliser.of(stabiliser))
        #: how the step is driven: step, sync_every and parallel, validated together once (driving.py).
        self.driving = Driving(step, sync_every, parallel, compile_step, batch_sizes)
        self._refuse(self.driving)
        self._graphs = {}  # the CUDA graphs of the fused step (step="cuda_graph") by batch size, made at first use
        if not (isinstance(checksum_every, int) and checksum_every >= 0):
            raise ValueError(f"checksum_every must be an int >= 0, got {checksum_every!r}")
        self.checksum_every = checksum_every
        #: the process-group work (multi_process.py): which rows of V are here, the collectives.
        #: V's rows are drawn block by block from one seed, so that a shard can be made
        #: alone (a sharded head never holds all of V) and equals the same rows unsharded.
        self.processes = processes_for(parallel, num_classes)
        for buf in STATE:  # every buffer, as state.py declares it
            self.register_buffer(buf.name, buf.initial(self), persistent=buf.persistent)
        self._uinv_fresh = True  # host-side: the forward must not read a device flag
        #: the board its flags are read with: a training loop's device flags registered on it
        #: ride on the same transfer (heads/flag_board.py)
        self.flag_board = FlagBoard()
        self._replan()
        if self.processes.joined:
            self.refresh_bookkeeping()

    @property
    def repairs(self) -> Repairs:
        """The repairs, with their settings (stabiliser.py). Another one makes the step's plan
        again: the plan holds their U^-1 route and the fold's thresholds."""
        return self._repairs

    @repairs.setter
    def repairs(self, value: Repairs) -> None:
        replacing = "_repairs" in self.__dict__
        self._repairs = value
        if replacing:
            self._replan()

    @property
    def stabiliser(self) -> Stabiliser:
        """The repairs' settings."""
        return self.repairs.settings

    def _refuse(self, driving: Driving) -> None:
        """The modes this head cannot take, each refused in one line with the reason (plan.py)."""
        why = head_refusal(driving)
        if why is not None:
            raise ValueError(why)

    def _drive(self, **fields) -> None:
        """Driving settings changed (validated with the others by ``Driving``, refused in one line
        where this head cannot take them), then the plan made again; a new ``step`` drops the CUDA
        graphs. The device flags go on as they are: every ``sync_every`` takes the same device part."""
        driving = dataclasses.replace(self.driving, **fields)
        self._refuse(driving)
        self.driving = driving
        self._replan()
        if "step" in fields:
            self._graphs = {}

    def _replan(self) -> None:
        """The step's plan (plan.py) made again: at a change of a setting, the device or the process group."""
        self.plan: StepPlan = plan_for(self)

    def _take_the_states_device(self, state_dict, prefix: str) -> None:
        super()._take_the_states_device(state_dict, prefix)
        self._replan()  # the device may have changed (load_state_dict's assign), as in ``_apply``

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        checks = self.step_checks
        if checks.rho_max is not None:  # the flags' device scalar follows the buffers (a state loaded, then moved)
            like = self.cond_bound  # (out of the meta device, to_empty(): no bound yet)
            checks.rho_max = torch.zeros_like(like) if checks.rho_max.is_meta else checks.rho_max.to(like)
        self._replan()  # the device may have changed
        return out

    @property
    def sharded(self) -> bool:
        return self.processes.sharded

    @property
    def row_lo(self) -> int:
        """V holds the rows of classes [row_lo, row_hi): all of them unless sharded."""
        return self.processes.lo

    @property
    def row_hi(self) -> int:
        return self.processes.hi

    # -- the driving settings (settings.py's ``Driven``: set through ``_drive``) ---------------
    #: where the update runs: "autograd", "fused" or "cuda_graph"; how often the flags are read
    step, sync_every = Driven("step"), Driven("sync_every")
    #: whether the step's device part runs compiled whole (driver.py): "auto" (on a CUDA device,
    #: where nothing refuses it), True or False
    compile_step = Driven("compile")
    #: the rows a compiled step (or a CUDA graph) pads a batch to, so that any m compiles (or is
    #: captured) once per size (batch_shapes.py): "pow2" (16, 32, 64, ...) or a sequence of sizes
    batch_sizes = Driven("batch_sizes")

    @property
    def graph_sizes(self) -> tuple[tuple[int, int], ...]:
        """The batch sizes (rows, slots) a CUDA graph of the step was captured for (``step="cuda_graph"``)."""
        return tuple(self._graphs)

    @property
    def compiles(self) -> bool:
        """Whether the step runs compiled now (``compile_step`` on this device, nothing refusing it)."""
        return self.plan.compiled

    def compiles_on(self, device: torch.device) -> bool:
        """Whether the step runs compiled once the head is on ``device`` (plan.compiles_on)."""
        return compiles_on(self.driving, torch.device(device))

    @property
    def parallel(self) -> str:
        return self.driving.parallel

    @property
    def mode(self) -> Driving:
        """Deprecated alias of ``driving`` (one release)."""
        warnings.warn("head.mode is deprecated: use head.driving", DeprecationWarning, stacklevel=2)
        return self.driving

    @property
    def checker(self):
        """Deprecated alias of ``step_checks`` (one release)."""
        warnings.warn("head.checker is deprecated: use head.step_checks", DeprecationWarning, stacklevel=2)
        return self.step_checks

    @property
    def deferred_checks(self) -> bool:
        """True with ``sync_every > 1``: the training step never waits for the device; its
        checks raise device flags that ``sync()`` reads every ``sync_every`` steps."""
        return self.plan.deferred

    def cannot_accumulate(self) -> str | None:
        return self.driving.cannot_accumulate() or super().cannot_accumulate()

    def _hidden_grad(self, saved, grad: Tensor) -> Tensor:
        return exact_step.hidden_grad(self.plan, driver.step_state(self), saved, grad)[0]

    @property
    def uinv_fresh(self) -> bool:
        """Whether U^-1 is up to date (steps that solve with U leave it behind)."""
        return self._uinv_fresh

    def get_extra_state(self):
        checks = self.step_checks
        # the steps at the flags' last read: a resumed run's next read runs the repairs that fell due
        # since that read, as the saved run's would
        out = {**super().get_extra_state(), "uinv_fresh": self._uinv_fresh, "flags_read_at": list(checks.synced),
               # a bad batch's step not yet read: the resumed run's next read raises for it (no host read)
               "bad_input": self._bad_input.detach().clone(),
               # a loss factor not yet read: the resumed run's next read warns of it
               "loss_factor": self._loss_factor.detach().clone()}
        if self.plan.neumann == "adaptive":  # a resumed run goes on
            out["neumann_factors"] = checks.factors  # with the factors its last read chose
            if checks.rho_max is not None:  # and the largest rho bound of the steps since that read
                out["rho_max"] = checks.rho_max.detach().clone()  # a device scalar: no host read
        if self.V.shape[0] != self.num_classes:  # V is one rank's shard: which rows (checked on load)
            out[V_ROWS] = (self.row_lo, self.row_hi)
        return out

    def set_extra_state(self, state) -> None:
        super().set_extra_state(state)
        self._uinv_fresh = bool(state.get("uinv_fresh", False))  # unknown: refresh when needed
        # buffers load before extra state; the flags are read every sync_every steps counted from the
        # first (taken or skipped), so that a resumed run reads them, and repairs, where the run never
        # stopped would
        steps, skipped = int(self.steps), int(self.skipped_nonfinite)
        # the host's side of the flags as a new head loading this state holds it, whatever this head
        # ran before (a load in the same process: Lightning's tuner, the Trainer's best model)
        self.step_checks = DeviceFlags()
        self.step_checks.synced = tuple(int(v) for v in state.get("flags_read_at", (steps, skipped)))
        self.step_checks.calls = steps + skipped
        if "neumann_factors" in state:
            self.step_checks.factors = int(state["neumann_factors"])
        if "rho_max" in state:
            self.step_checks.rho_max = state["rho_max"].to(self.device, self.cond_bound.dtype).reshape(()).clone()
        bad, factor = state.get("bad_input"), state.get("loss_factor")
        self._bad_input.copy_(bad.reshape(()) if bad is not None else torch.zeros((), dtype=torch.long))
        self._loss_factor.copy_(factor.reshape(()) if factor is not None else torch.zeros((), dtype=torch.float64))

    # -- the implicit W -----------------------------------------------------------------
    @torch.no_grad()
    def weight(self) -> Tensor:
        """The implicit W: its rows row_lo:row_hi when sharded."""
        self._ensure_distributed()
        return weight_of(self.V, self.U, self.omega)

    @torch.no_grad()
    def reset_weight(self, W: Tensor | None = None) -> None:
        """Make the implicit W equal to W: V = W, U = U^-1 = I, omega = 0, O(D d^2) bookkeeping.
        Without W: the head as constructed (initial W from its seed, counters zero), e.g.
        after ``to_empty()`` of a head built on the meta device."""
        if W is None:
            self._ensure_distributed()
            for buf in STATE:  # every buffer as constructed (state.py)
                getattr(self, buf.name).copy_(buf.initial(self, self.device))
            self.step_checks = DeviceFlags()
            self._reset_factors()
            return
        self._check_weight(W)
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
        self.processes.all_reduce_(VtV)  # sharded: V^T V over every rank's rows
        self.processes.all_reduce_(v1)
        U, w = self.U, self.omega
        Utv = U.T @ v1
        Q = U.T @ VtV @ U + torch.outer(Utv, w) + torch.outer(w, Utv) + self.num_classes * torch.outer(w, w)
        self.Q.copy_(0.5 * (Q + Q.T))
        self.wbar.copy_(Utv + self.num_classes * w)
        self._version += 1

    # -- driving the step (driver.py around exact_step.py) ------------------------------------------
    # step="autograd": base.py's forward runs driver.forward_step, loss.backward() driver.backward;
    # train_step (and step="fused"/"cuda_graph") runs both at once: driver.whole_step.
    @own_precision
    @torch.no_grad()
    def train_step(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None = None,
                   rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Forward, backward and update in one call, without autograd: the loss and dL/dH
        (what ``head(H, idx).backward()`` gives H). With ``sync_every > 1`` it reads
        nothing on the host: its device part, exact_step.py's ``device_step``, is what
        ``CudaGraphStep`` captures. ``rows``: where H is a batch already padded to a batch size
        (batch_shapes.py), its real rows, a device count (the "mean" reduction divides by it)."""
        Hx, idx, T = self._prepare_everywhere(H, target_idx, target_val, step=True)
        self.check_decay()
        return driver.whole_step(self, H, Hx, idx, T, rows)

    def _step_in_forward(self, H: Tensor, Hx: Tensor, idx: Tensor, T: Tensor) -> Tensor:
        if self.driving.step == "cuda_graph":  # one graph a batch size (batch_shapes.py), captured at its first batch
            size = padded_rows(H.shape[0], self.driving.batch_sizes), padded_slots(idx.shape[1])
            graph = self._graphs.get(size)
            if graph is None:
                graph = self._graphs[size] = CudaGraphStep(self, *size, hidden_dtype=H.dtype)
            return _AppliedLoss.apply(H, *graph(H.detach(), idx, T))
        return _AppliedLoss.apply(H, *driver.whole_step(self, H, Hx, idx, T))

    def device_lr(self) -> Tensor:
        """The lr as the device scalar the deferred step reads (``sync_every > 1``; a
        captured CUDA graph reads it at each replay), refilled here, outside any capture,
        when ``lr`` changed."""
        return self.step_checks.lr(self)

    def pin_device_lr(self, value: float | None) -> None:
        """Hold the device lr at ``value`` whatever ``lr`` (a graph's warm-up steps at 0);
        None: follow ``lr`` again."""
        self.step_checks.pin_lr(self, value)

    def count_replay(self) -> None:
        """Count one replay of a captured step (CudaGraphStep): a backward of an earlier
        forward is stale now, and the flags are read every ``sync_every`` replays."""
        self._version += 1
        if self.step_checks.tick(self):
            self.sync()

    @torch.no_grad()
    def sync(self, repair: bool = True) -> None:
        """Read the step's checks (DeviceFlags: one host synchronisation; it warns about
        skipped steps), run the repairs that fell due since the last read, and raise if a
        batch since then had bad targets. Nothing to read: nothing happens. ``repair=False``
        (the end of training): the read only reports, and changes nothing the next steps depend
        on, so that a run's state never depends on where it stopped (and was resumed)."""
        read = self.step_checks.read(self, peek=not repair)
        if read is None:
            return
        n_prev, n, cond_bound, bad_step = read
        if repair:
            self.run_due(n_prev, n, cond_bound)
        if bad_step:
            self.step_checks.raise_bad_input(self, bad_step)

    @torch.no_grad()
    def run_due(self, n_prev: int, n: int, cond_bound: float | None = None) -> None:
        """The repairs that fell due between step n_prev and step n, and the replica check
        (``cond_bound``: cond(U)'s bound as the flags read it; None: read here)."""
        self.repairs.run_due(self, n_prev, n, cond_bound)
        if fell_due(self.checksum_every, n_prev, n):
            self.check_replicas()

    @torch.no_grad()
    def stabilise(self) -> None:
        """Recompute U^-1, then bring U's singular values into [sv_min, sv_max] (exact, W unchanged)."""
        self.repairs.stabilise(self)

    # -- more than one process (head.processes: multi_process.py; docs/multi_gpu.md) -----
    @torch.no_grad()
    def distribute(self, process_group=None) -> None:
        """Join the ranks of ``process_group`` (default: the whole world; alone when
        torch.distributed is not initialised). Every rank must call it: rank 0's state
        is taken by all (its V rows, for a shard); a sharded head makes its own rows."""
        if self.parallel == "none":
            return
        pg, old = ProcessGroup.current(process_group), self.processes
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
        self.processes = new
        self._replan()
        if int(self.steps):
            # Q and wbar, rank 0's as V is, hold W^T W and W^T 1 already: recomputed, they would
            # move by rounding, and a run resumed from a checkpoint would leave the run it continues.
            self._version += 1  # no stale backward survives this
        else:
            self.refresh_bookkeeping()  # also bumps the version

    @torch.no_grad()
    def gather_v(self, dst: int = 0) -> Tensor | None:
        """All of V on rank ``dst`` (on the host), None on the other ranks; every rank must
        call it. A checkpoint holding it loads into a head sharded over any number of ranks."""
        return self.processes.gather_v(self.V, dst)

    def state_hash(self) -> int:
        """A hash of the bits of the state every rank must hold alike (V too unless sharded)."""
        return bit_hash([getattr(self, n) for n in self.processes.hashed_state()])

    def check_replicas(self) -> None:
        """Raise on every rank when the ranks' shared state differs in any bit."""
        self.processes.check_replicas(self)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        without_placeholder_extra_state(state_dict, prefix)
        V = state_dict.get(prefix + "V")
        extra = state_dict.get(prefix + "_extra_state")
        read_at, rho = (extra or {}).get("flags_read_at"), (extra or {}).get("rho_max")
        if read_at is not None and not (isinstance(read_at, (list, tuple)) and len(read_at) == 2
                                        and all(isinstance(v, int) and v >= 0 for v in read_at)):
            raise ValueError(f"the state's flags_read_at must be two step counts (ints >= 0), got {read_at!r}")
        if rho is not None and not (isinstance(rho, Tensor) and rho.numel() == 1 and math.isfinite(float(rho))
                                    and float(rho) >= 0):
            raise ValueError(f"the state's rho_max must be one finite value >= 0, got {rho!r}")
        bad = (extra or {}).get("bad_input")
        if bad is not None and not (isinstance(bad, Tensor) and bad.numel() == 1 and not bad.is_floating_point()
                                    and not bad.is_complex() and int(bad) >= 0):
            raise ValueError(f"the state's bad_input must be one step number (an int >= 0), got {bad!r}")
        factor = (extra or {}).get("loss_factor")
        if factor is not None and not (isinstance(factor, Tensor) and factor.numel() == 1 and factor.is_floating_point()
                                       and math.isfinite(float(factor)) and float(factor) >= 0):
            raise ValueError(f"the state's loss_factor must be one finite value >= 0, got {factor!r}")
        files = (extra or {}).get("v_files")
        if V is not None and (files is not None or (self.sharded and V.shape[0] == self.num_classes != self.V.shape[0])):
            self._ensure_distributed()
            # A whole V (from gather_v), or one file per rank (shard_files): keep this rank's rows.
            mine = load_rows(files, self.row_lo, self.row_hi) if files is not None else V[self.row_lo:self.row_hi]
            state_dict = {**state_dict, prefix + "V": mine}
        rows = state_dict.pop(prefix + V_ROWS, None)  # a saver of tensors only records them so
        rows = (extra or {}).get(V_ROWS, rows.tolist() if rows is not None else None)
        if V is not None and V.shape[0] != self.num_classes and files is None:
            if rows is None and extra is not None:  # a whole V: a shard's extra state records its rows
                raise ValueError(f"the state's V has {V.shape[0]} rows but this head has num_classes="
                                 f"{self.num_classes}: it was saved by a head of another size")
            self._check_shard(V, rows)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "Uinv" in state_dict and extra is None:
            self._uinv_fresh = False  # loaded one tensor at a time, without the flag: refreshed when needed

    def _check_shard(self, V: Tensor, rows) -> None:
        """A state whose V is one rank's shard (``rows``: the rows it holds, when recorded) loads
        only into the head that holds those rows; else one ValueError, on every rank of a head
        spread over several (all of them load the same file, so all get here), before any
        buffer is written."""
        held = (self.row_lo, self.row_hi) if self.V.shape[0] != self.num_classes else (0, self.num_classes)
        mine = (tuple(rows) == held) if rows is not None else (V.shape == self.V.shape and held != (0, self.num_classes))
        saved = f"rows {rows[0]}:{rows[1]}" if rows is not None else f"{V.shape[0]} rows"
        err = None if mine else (
            f"the state holds {saved} of V's {self.num_classes}, one rank's shard of a sharded head, and this head "
            f"holds rows {held[0]}:{held[1]}: it resumes only where those rows are held; save all of V (every rank: "
            "head.gather_v(), or for a patched model gather_head_for_checkpoint(model), before the save) for a "
            "checkpoint that resumes on any number of processes")
        if self.processes.joined and self.processes.world > 1:
            said = self.processes.pg.all_gather_objects(err)
            first = next((r for r, text in enumerate(said) if text is not None), None)
            if first is not None and err is None:
                err = f"rank {first} cannot load this state ({said[first]})"
        if err is not None:
            raise ValueError(err)

    # -- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def _eval_loss(self, Hx, idx, T):
        Hx, idx, T, rows = self.processes.collect(Hx, idx, T, training=False)
        q, s, A = self._outputs(Hx, idx)
        per_example = self.loss_fn(q, s, A, T, num_classes=self.num_classes, y_sq=self.y_sq(idx, T))
        return self.reduce(per_example, idx) if rows is None else self.reduce(per_example[rows], idx[rows])

    def _outputs(self, Hx: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, s and the target outputs A (exact_step.py's ``outputs``)."""
        q, s, _, HUt, _, ht = exact_step.outputs(self.plan, driver.step_state(self), Hx)
        return q, s, self.plan.gather_dot(self.V, idx, HUt, ht)

    @own_precision
    @torch.no_grad()
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """The loss's score (``loss_fn.score``: the model's own ranking) of the outputs
        O[:, start:end] = (H U^T) V[start:end]^T + H omega: O(m (end - start) d).
        A sharded head scores only its own classes (start:end within row_lo:row_hi)."""
        Hx, _, _ = self._prepare_everywhere(hidden, None, None)
        end = class_range(self.num_classes, start, end)
        if self.sharded and not self.row_lo <= start <= end <= self.row_hi:
            raise ValueError(f"this shard holds classes {self.row_lo}:{self.row_hi}, not {start}:{end}")
        rows = self.V[start - self.row_lo:end - self.row_lo]
        return self.loss_fn.score(torch.addmm((Hx @ self.omega)[:, None], Hx @ self.U.T, rows.T))

    @own_precision
    @torch.no_grad()
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """log p(target) in O(d^2) per example (spherical and Taylor softmax)."""
        Hx, idx, rows = self._gather_eval(hidden, target_idx)
        q, s, A = self._outputs(Hx, idx)
        logp = self.loss_fn.log_prob(q, s, A, num_classes=self.num_classes).masked_fill(idx < 0, 0.0)
        logp = logp if rows is None else logp[rows]
        return logp[:, 0] if target_idx.dim() == 1 else logp

    #: the counters ``stats()`` gives (ints), then the conditioning of U (floats)
    STAT_COUNTERS = ("steps", "skipped_nonfinite", *REPAIR_COUNTERS)
    STATS = (*STAT_COUNTERS, "cond_estimate", "cond_bound")

    def stats(self) -> dict[str, float]:
        """Counters of every repair and the conditioning of U, for logging: one host transfer."""
        return self.stats_of(torch.stack([getattr(self, n).to(torch.float64) for n in self.STATS]).tolist())

    def logged_stats(self) -> dict[str, float]:
        """No device read under device flags: ``stats()`` as the flags' last read took them (in
        the same transfer; {} before the first); else ``stats()``."""
        return dict(self.step_checks.stats) if self.plan.deferred else self.stats()

    def stats_of(self, values: list[float]) -> dict[str, float]:
        """``STATS``' values, read in that order, as ``stats()`` gives them."""
        return {n: int(v) if n in self.STAT_COUNTERS else v for n, v in zip(self.STATS, values)}
