"""The shell of the spherical heads, shared by the factored head and its naive reference: the
``nn.Module`` (constructor, input checks, lr and weight decay, the loss on m-sized tensors), the
thin ``autograd.Function`` whose backward is driver.py's ``autograd_backward`` (the step in
backward), the token of each training forward, and the public face of ``self.pending``
(pending.py). The step itself is the head's: ``_forward_step``, ``_backward_step`` and the other
methods subclasses provide.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import weakref

import torch
from torch import Tensor, nn

from ..heads.base import OutputHead, keys_problem
from ..heads.samplers import slots_num_samples
from ..heads.state_dtype import STATE_DTYPES, kept_in_dtype
from ..heads.targets import IGNORE_INDEX, target_slots
from ..heads.user_warning import warn
from ..losses import SphericalLoss, make_loss
from . import driver, exact_step
from .blocks import BLOCK, row_blocks
from .driving import Driving
from .multi_process import Processes
from .negatives import NegativeSampling, Negatives
from ..heads.preconditioner import Preconditioner
from .settings import AUTO, Setting, bound_or_off, finite, on_with_sampled, one_of, positive_int
from .pending import PendingRows
from .plan import StepPlan, negatives_kind
from .precision import own_math

#: "mean": over all m rows (padded rows count, adding 0); "mean_real": over the rows with at
#: least one real target (as F.cross_entropy with ignore_index); "sum".
REDUCTIONS = ("mean", "mean_real", "sum")


class _ForwardToken:
    """One training forward: the dL/dH its backward handed on, and that backward's gradient."""
    dH: Tensor | None = None
    grad: Tensor | None = None


class _HeadLoss(torch.autograd.Function):
    """Returns the loss in forward; in backward, returns dL/dH and lets the head take its SGD
    step with the gradients of this very forward (or keep its rows, when attached)."""

    @staticmethod
    def forward(ctx, H: Tensor, head: "SphericalHeadBase", Hx: Tensor, idx: Tensor, T: Tensor, token):
        ctx.rows = None
        if not head.processes.alone:  # every rank's rows
            Hx, idx, T, ctx.rows = head.processes.collect(Hx, idx, T, training=True)
        ctx.m = Hx.shape[0]  # dL/dH's rows: a step padded to a batch size (batch_shapes.py) hands these on
        loss, saved = head._forward_step(Hx, idx, T)
        # token None: a frozen head (eval mode), which hands dL/dH on and never steps.
        ctx.head, ctx.saved, ctx.version, ctx.token, ctx.in_dtype = head, saved, head._version, token, H.dtype
        return loss

    #: dL/dH and the head's step with this forward's gradients: driver.py's
    backward = staticmethod(driver.autograd_backward)


class _AppliedLoss(torch.autograd.Function):
    """The loss of a step the head has already taken (``step="fused"`` or ``"cuda_graph"``):
    ``_AppliedLoss.apply(H, loss, dH)`` is ``loss`` in forward and hands ``dH * grad`` to H."""

    @staticmethod
    def forward(ctx, hidden: Tensor, loss: Tensor, dH: Tensor) -> Tensor:
        ctx.save_for_backward(dH)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (dH,) = ctx.saved_tensors
        return dH * grad, None, None


def without_placeholder_extra_state(state_dict: dict, prefix: str) -> None:
    """Drop an extra state that is not the head's dict: torch.distributed.checkpoint's
    placeholder, which ``set_model_state_dict`` passes when it loads one tensor at a time
    (Lightning's ModelParallelStrategy, the app's ``fsdp2``); the extra state is then left as it
    is, for that loader to set itself (``set_extra_state``)."""
    extra = state_dict.get(prefix + "_extra_state")
    if extra is not None and not isinstance(extra, dict):
        del state_dict[prefix + "_extra_state"]


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, read in blocks of rows (V: no D x d temporary)."""
    return all(bool(torch.isfinite(blk).all()) for _, blk in row_blocks(t.reshape(t.shape[0], -1) if t.dim() else t[None]))


def persistent_keys(module: nn.Module, prefix: str = "") -> set[str]:
    """The keys torch's ``load_state_dict`` expects of ``module``: its persistent parameters and
    buffers, its extra state where its class keeps one, and its children's."""
    keys = {prefix + n for n, t in {**module._parameters, **module._buffers}.items()
            if t is not None and n not in module._non_persistent_buffers_set}
    if type(module).set_extra_state is not nn.Module.set_extra_state:
        keys.add(prefix + "_extra_state")
    for name, child in module._modules.items():
        if child is not None:
            keys |= persistent_keys(child, prefix + name + ".")
    return keys


#: what torch.compile(model, fullgraph=True) says where it meets the head (Dynamo's "Skip inlining")
COMPILED_MODEL = ("a compiled model runs the factored head outside its graphs, and the head compiles its own step: "
                  "compile the model without fullgraph=True, or its body alone (body.compile(fullgraph=True))")


class SphericalHeadBase(OutputHead):
    """A self-updating head with a spherical loss; subclasses hold W explicitly or factored."""

    self_updating = True

    def __init__(self, num_classes: int, hidden_dim: int, loss: str | SphericalLoss = "sampled",
                 loss_kwargs: dict | None = None, lr: float | None = None, weight_decay: float = 0.0,
                 bias: bool = True, reduction: str = "mean", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, init_std: float | None = None,
                 generator: torch.Generator | None = None, ignore_index: int = IGNORE_INDEX,
                 negatives: Negatives | dict | str | None = AUTO,
                 preconditioner: Preconditioner | dict | str | None = AUTO,
                 tf32: bool = False, clip_norm: float | None = None):
        super().__init__()
        if not (isinstance(num_classes, int) and num_classes >= 1):
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not (isinstance(hidden_dim, int) and hidden_dim >= 1):
            raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
        self.reduction = reduction
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or 0 <= ignore_index < num_classes:
            raise ValueError(f"ignore_index must be an int outside the class ids [0, {num_classes}) "
                             f"(default {IGNORE_INDEX}), got {ignore_index!r}")
        self.ignore_index = ignore_index
        if not isinstance(tf32, bool):
            raise ValueError(f"tf32 must be a bool, got {tf32!r}")
        #: float32 matrix products in TensorFloat-32 on a GPU (opt-in: the exact step's products in
        #: full float32 by default, whatever the loop's torch.set_float32_matmul_precision)
        self.tf32 = tf32
        if dtype not in STATE_DTYPES:
            raise TypeError(f"the head keeps its state in torch.float32 or torch.float64, got {dtype!r}")
        self.num_classes, self.hidden_dim = num_classes, hidden_dim
        self.bias = bool(bias)
        #: columns of the implicit W: the hidden size, plus one constant column for the bias.
        self.width = hidden_dim + int(self.bias)
        loss_fn = loss if isinstance(loss, SphericalLoss) else make_loss(loss, **(loss_kwargs or {}))
        self.loss_fn = loss_fn.for_classes(num_classes)  # settings left null follow the loss's rule in D
        self.has_log_prob = self.loss_fn.normalised
        self.lr = lr if lr is not None else self.loss_fn.default_lr_for(num_classes)  # the loss's own (Z-loss: 1.0)
        self.weight_decay = weight_decay
        self.clip_norm = clip_norm
        self._version = 0  # bumped by every change of state: guards stale backward calls
        self._uninitialised = False  # moved off the meta device: no state until reset_weight()
        self._strict_load = False  # in a strict load_state_dict of the head itself: its keys checked
        # the state's dtype and device, followed by every move (_apply)
        # (the device as its tensors name it: "cuda" is cuda:<current>, or "cuda" != H.device)
        self._factory = {"dtype": dtype, "device": torch.empty(0, device=device).device}
        #: how the step is driven (driving.py): the naive head steps in backward, one process
        self.driving = Driving(sync_every=1, compile=False)
        #: the step's checks (driver.py): the naive head's at once on the host, the factored
        #: head's device flags, read every ``sync_every`` steps
        self.step_checks = driver.DeviceFlags()
        #: the rows kept for the attached optimizer's step (pending.py)
        self.pending = PendingRows()
        self._open = None  # weakref to the token of the last training forward
        self._warned: set[str] = set()
        #: the process-group work (multi_process.py): one process, every collective the
        #: identity (the factored head holds a replicated or sharded one with ``parallel``)
        self.processes = Processes(num_classes)
        self._rows_per_rank: int | None = None  # rows_per_rank: the ranks' first batches decide
        # The seed of the initial W (drawn on the host, so that a head built on the meta
        # device has one too): ``reset_weight()`` redraws the same W from it.
        number = isinstance(init_std, (int, float)) and not isinstance(init_std, bool)
        if init_std is not None and not (number and math.isfinite(init_std) and init_std > 0):
            raise ValueError(f"init_std must be a finite number > 0 or None (the loss's rule), got {init_std!r}")
        # the loss's choice by default (docs/learning_at_scale.md)
        self._init_std = float(init_std) if init_std is not None else self.loss_fn.init_std(num_classes, self.width)
        self._init_seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator,
                                            device=generator.device if generator is not None else "cpu"))
        #: sampled classes as slots of the step (negatives.py), with the composite loss only
        settings = Negatives.of(on_with_sampled(negatives, self.loss_fn.sampled))
        if (settings is None) == self.loss_fn.sampled:
            raise ValueError(f"loss {self.loss_fn.name!r} needs negatives (e.g. negatives=dict(num=64))"
                             if settings is None else
                             f"negatives need a loss with sampled classes ('sampled'), not {self.loss_fn.name!r}")
        if settings is not None and settings.num is None:  # S for this D, as every sampling head
            settings = dataclasses.replace(settings, num=slots_num_samples(num_classes))
        self.negatives = None if settings is None else NegativeSampling(settings, num_classes, self._init_seed)
        #: the right preconditioner of the update (preconditioner.py); None: the plain SGD step
        self.preconditioner = Preconditioner.of(on_with_sampled(preconditioner, self.loss_fn.sampled))
        #: every mode of the step (plan.py): the naive head's, host checks in backward, one process
        #: (the factored head makes its own from its settings)
        self.plan = StepPlan(step="autograd", deferred=False, negatives=negatives_kind(self.negatives),
                             preconditioner=self.preconditioner, num_classes=num_classes, width=self.width,
                             weight_decay=self.weight_decay, clip_norm=self.clip_norm, collectives=self.processes,
                             loss=self.loss_fn, reduction=self.reduction, sampling=self.negatives)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's state (float32 or float64): it follows ``.double()``, ``.float()``
        and ``.to(dtype)``; the head computes in it whatever the dtype of H or the autocast context."""
        return self._factory["dtype"]

    @property
    def device(self) -> torch.device:
        """The device of the head's state: it follows ``.to()``, ``.cuda()``, ``to_empty()``."""
        return self._factory["device"]

    def __getstate__(self) -> dict:
        """A pickled or deep-copied head (``torch.save(model)``, a spawned process, ``copy.deepcopy``)
        is the head as its checkpoint holds it: its state and settings, without its ties to this
        process's loop: no training forward awaiting its backward, not attached (the optimizer is not
        in the copy), no rows kept for that optimizer's step (warned where there were), no CUDA graph."""
        out = super().__getstate__()
        pending = out["pending"] = copy.copy(self.pending)
        if pending.rows:
            warn(f"{type(self).__name__}: the copy does not hold the {pending.rows} rows kept for the attached "
                 "optimizer's next step (copy or save at optimizer-step boundaries)")
        pending.optimizer = pending.hook = pending.scaler = pending.accumulate = None
        pending.discard()
        out["_open"] = None
        if "_graphs" in out:
            out["_graphs"] = {}
        return out

    def _apply(self, fn, recurse=True):
        # Every dtype/device move (.double(), .to(), .half(), .cuda(), to_empty()) comes here.
        # The state follows a move to float32/float64; half precision would make the exact
        # step too coarse, so the state stays as it is then (moved to the new device only).
        was_meta = self.device.type == "meta"
        probe = fn(torch.zeros((), dtype=self.dtype, device=self.device))
        if probe.dtype not in STATE_DTYPES:
            warn(f"{type(self).__name__} keeps its state in {self.dtype}, not {probe.dtype}: it takes H in any "
                 "float dtype and returns dL/dH in H's dtype (docs/factored_head.md, 'Precision, padding and dtype')")
            fn = kept_in_dtype(fn, probe.device)
        out = super()._apply(fn, recurse)
        self._factory["dtype"], self._factory["device"] = probe.dtype if probe.dtype in STATE_DTYPES \
            else self.dtype, probe.device
        self._uninitialised |= was_meta and probe.device.type != "meta"  # to_empty(): uninitialised memory
        self._graphs = {}  # a captured CUDA graph holds the old tensors
        self._version += 1  # a pending backward from before the move is stale
        return out
    # -- hyperparameters the training loop may change (settings.py's ``Setting``) ----------
    lr = Setting(finite("lr"))
    weight_decay = Setting(finite("weight_decay", positive=False), planned=True)
    #: the bound on the norm of the step's gradient of W (times P with the preconditioner): a larger
    #: one is scaled down to it before the SGD step, as ``torch.nn.utils.clip_grad_norm_`` would
    #: (the weight decay is not scaled); None (or 0): no bound
    clip_norm = Setting(bound_or_off("clip_norm"), planned=True)
    #: how the rows' losses make the minibatch loss: one of ``REDUCTIONS``
    reduction = Setting(one_of("reduction", REDUCTIONS), planned=True)

    def _in_plan(self, **fields) -> None:
        """A setting the step's plan holds, changed in it (before the plan is made: nothing to change)."""
        if "plan" in self.__dict__:
            self.plan = dataclasses.replace(self.plan, **fields)

    def get_extra_state(self):
        out = {"lr": self._lr, "weight_decay": self._weight_decay,
               "loss": {"name": self.loss_fn.name, **self.loss_fn.hparams()}}
        if self.negatives is not None:  # the generator's state: a resumed run draws the same negatives
            out["negatives"] = self.negatives.state()
        out["preconditioner"] = self._preconditioner_settings()
        return out

    def _preconditioner_settings(self) -> dict | None:
        """What a checkpoint records of the preconditioner, and compares when loaded."""
        return None if self.preconditioner is None else dataclasses.asdict(self.preconditioner)

    def set_extra_state(self, state) -> None:
        self.lr, self.weight_decay = state["lr"], state["weight_decay"]
        if self.negatives is not None and "negatives" in state:
            self.negatives.load_state(state["negatives"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        without_placeholder_extra_state(state_dict, prefix)
        # Refuse a state saved with another loss (or what this head does not take) before any
        # buffer or setting is changed.
        if prefix + "row_acc" in state_dict:
            raise ValueError("the state holds per-class step sizes (row_acc), which this head does not take: "
                             "load it without that entry to go on with the plain exact step")
        extra = state_dict.get(prefix + "_extra_state", {})
        saved = extra.get("loss")
        mine = {"name": self.loss_fn.name, **self.loss_fn.hparams()}
        if saved is not None and saved != mine:
            raise ValueError(f"the state was saved with loss {saved} but this head has {mine}")
        if "preconditioner" in extra and extra["preconditioner"] != self._preconditioner_settings():
            raise ValueError(f"the state was saved with preconditioner {extra['preconditioner']} but this head "
                             f"has {self._preconditioner_settings()}")
        saved_neg = extra.get("negatives")
        if saved_neg is not None and self.negatives is not None:
            self.negatives.check_state(saved_neg)
        for name in ("lr", "weight_decay"):  # set after the buffers have loaded: checked before
            if name in extra:
                try:
                    getattr(type(self), name).check(extra[name])
                except ValueError as e:
                    raise ValueError(f"the state's {e}") from None
        self._refuse_tensors(state_dict, prefix)
        problem = self._keys_problem(state_dict) if prefix == "" else None
        if problem is not None:
            raise RuntimeError(f"{type(self).__name__}: {problem}; nothing was loaded")
        self._version += 1
        self._uninitialised = False
        if (args[0] if args else kwargs.get("local_metadata", {})).get("assign_to_params_buffers"):
            self._take_the_states_device(state_dict, prefix)
        if self.pending.rows:  # attached: rows of the state before, for a step that would land on the new one
            warn(f"{type(self).__name__}: loading a state drops the {self.pending.rows} rows kept for the "
                 "attached optimizer's next step (load at optimizer-step boundaries)")
            self.pending.discard()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _take_the_states_device(self, state_dict, prefix: str) -> None:
        """``load_state_dict(assign=True)`` (a model built on the meta device, then given its state):
        the buffers become the state's tensors, so the head takes their device and dtype, and its
        buffers that no state holds (non-persistent) are made anew there, as ``_apply`` would move them."""
        ref = next((state_dict[prefix + n] for n in self._buffers if n not in self._non_persistent_buffers_set
                    and isinstance(state_dict.get(prefix + n), Tensor) and state_dict[prefix + n].is_floating_point()),
                   None)
        if ref is None or (ref.device, ref.dtype) == (self.device, self.dtype):
            return
        if ref.dtype not in STATE_DTYPES:
            raise ValueError(f"the state's tensors are {ref.dtype}, which assign=True would make this head's: it keeps "
                             "its state in float32 or float64 (load without assign to cast them)")
        for n in self._non_persistent_buffers_set:
            b = self._buffers[n]
            self._buffers[n] = torch.zeros_like(b, device=ref.device, dtype=ref.dtype if b.dtype == self.dtype else b.dtype)
        self._factory["device"], self._factory["dtype"] = ref.device, ref.dtype
        self._graphs = {}  # a captured CUDA graph holds the old tensors

    #: keys a state holds or not by how it was saved (the factored head's: a shard's rows)
    OPTIONAL_KEYS: tuple[str, ...] = ()

    def state_problem(self, state_dict, strict: bool = True) -> str | None:
        """None: the head checks its state as it loads it, its keys after its own refusals of the
        state (``_load_from_state_dict``, ``_keys_problem``): a sharded V takes a shard of a whole
        one, or its rows from files."""
        return None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's ``load_state_dict``; with ``strict``, a key missing or not the head's refused in one
        line before anything loads (``_keys_problem``), where torch loads the rest first."""
        self._strict_load = strict
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self._strict_load = False

    def _keys_problem(self, state_dict) -> str | None:
        """In a strict ``load_state_dict`` of the head itself, a key missing or not the head's once the
        head's load pre-hooks have run (a patched model's, which take its tensors-only keys), as torch
        would find them after loading the rest; else None."""
        if not self._strict_load:
            return None
        local = dict(state_dict)
        for hook in self._load_state_dict_pre_hooks.values():
            hook(local, "", {}, True, [], [], [])
        return keys_problem(persistent_keys(self), set(local), self.OPTIONAL_KEYS)

    def _refuse_tensors(self, state_dict: dict, prefix: str) -> None:
        """Refuse, before any buffer is written, a state tensor torch would not load (another
        shape: torch copies the others and raises after) or one holding non-finite values."""
        mine = {**self._parameters, **self._buffers}
        for name, t in mine.items():
            v = state_dict.get(prefix + name)
            if not isinstance(v, Tensor) or t is None or name in self._non_persistent_buffers_set:
                continue
            if tuple(v.shape) != tuple(t.shape):
                raise ValueError(f"the state's {name} has shape {tuple(v.shape)} but this head's is {tuple(t.shape)}: "
                                 "it was saved by a head of another size")
            if v.is_floating_point() and v.device.type != "meta" and not all_finite(v):
                raise ValueError(f"the state's {name} holds non-finite values: refused, the head left as it was")

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, hidden_dim={self.hidden_dim}, loss={self.loss_fn.name}, "
                f"lr={self.lr}, weight_decay={self.weight_decay}, bias={self.bias}, reduction={self.reduction}, "
                f"ignore_index={self.ignore_index}, preconditioner={self.preconditioner}")

    # -- the step: what subclasses provide ------------------------------------------------
    def _forward_step(self, Hx: Tensor, idx: Tensor, T: Tensor) -> tuple[Tensor, object]:
        """The loss and what its backward reuses (``saved``); the head does not change."""
        raise NotImplementedError

    def _backward_step(self, saved, grad_out: Tensor) -> Tensor:
        """dL/dH, and the step taken with the gradients scaled by ``grad_out``."""
        raise NotImplementedError

    def _hidden_grad(self, saved, grad_out: Tensor) -> Tensor:
        """dL/dH alone: the head does not change."""
        raise NotImplementedError

    def _pending_record(self, saved, weight: Tensor):
        """What a micro-batch keeps for the optimizer's step, its loss gradients scaled by ``weight``."""
        raise NotImplementedError

    def _apply_records(self, records: list) -> None:
        """One exact step on the rows of all ``records`` (made with the current state)."""
        raise NotImplementedError

    def _step_in_forward(self, H: Tensor, Hx: Tensor, idx: Tensor, T: Tensor) -> Tensor:
        """The loss of a step taken in the forward (``step="fused"``, ``"cuda_graph"``)."""
        raise NotImplementedError

    def _eval_loss(self, Hx: Tensor, idx: Tensor, T: Tensor) -> Tensor:
        raise NotImplementedError

    def _ensure_distributed(self) -> None:
        if not self.processes.joined:
            self.distribute()

    def _prepare_everywhere(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None,
                            step: bool | None = None):
        """``prepare``, agreed on by every rank: one rank's bad input raises on all of them (a
        training step under device flags after the first: at the next read of the flags,
        the step void on every rank; padded_rows.py)."""
        self._ensure_distributed()
        step = self.in_training_step if step is None else step
        if self.processes.alone:
            return self.prepare(H, target_idx, target_val, step=step)
        return self.processes.agree(self, lambda: self.prepare(H, target_idx, target_val, step=step), step)

    def weight(self) -> Tensor:
        """The implicit W, materialised: (D, d), or (D, d + 1) with bias."""
        raise NotImplementedError

    def reset_weight(self, W: Tensor | None = None) -> None:
        """Make the implicit W equal to W; without W, the head as constructed (its initial W
        from its seed, every counter zero): the way to finish a head built on the meta
        device, after ``to_empty()``."""
        raise NotImplementedError

    def _check_weight(self, W) -> None:
        """Refuse a W for ``reset_weight`` of another shape than (D, width), or not finite."""
        if not isinstance(W, Tensor) or tuple(W.shape) != (self.num_classes, self.width):
            raise ValueError(f"W must have shape {(self.num_classes, self.width)}, got "
                             f"{tuple(W.shape) if isinstance(W, Tensor) else type(W).__name__}")
        if not torch.isfinite(W).all():
            raise ValueError("W has non-finite entries")

    def _init_rows(self, lo: int, hi: int, device=None) -> Tensor:
        """Rows lo:hi of the initial W: block c of rows comes from seed + c, drawn on the
        device itself (a GPU's generator gives other numbers than the CPU's, as it should:
        at D = 20M, d = 512 a host draw takes a minute)."""
        out = torch.empty(hi - lo, self.width, dtype=self.dtype, device=device)
        if out.device.type == "meta":
            return out
        for c in range(lo // BLOCK, -(-hi // BLOCK)):
            a, b = c * BLOCK, min((c + 1) * BLOCK, self.num_classes)
            g = torch.Generator(device=out.device).manual_seed(self._init_seed + c)
            blk = torch.randn(b - a, self.width, generator=g, dtype=self.dtype, device=out.device)
            s, e = max(a, lo), min(b, hi)
            out[s - lo:e - lo] = blk[s - a:e - a] * self._init_std
        return out

    def cannot_accumulate(self) -> str | None:
        """None: attach() makes it step at the optimizer's step (pending.py)."""
        return None

    def sync(self, repair: bool = True) -> None:
        """Read the step's checks now (the factored head's device flags; ``repair=False``: report
        only, run no repair); a head whose every check is read as it is made has nothing to read."""

    @property
    def in_training_step(self) -> bool:
        """Whether a forward now is a training step (the head updates itself in backward)."""
        return self.training and torch.is_grad_enabled()

    def check_decay(self) -> None:
        """Refuse lr * weight_decay >= 1: the decay factor 1 - lr wd would flip or zero W."""
        if self._lr * self._weight_decay >= 1:
            raise ValueError(f"lr * weight_decay = {self._lr * self._weight_decay} >= 1: the decay would flip W")

    # -- input handling -----------------------------------------------------------------
    def prepare(self, H: Tensor, target_idx: Tensor | None = None, target_val: Tensor | None = None,
                step: bool | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Validate inputs; return H with the bias column in the head's dtype (``augment``),
        idx as (m, K) int64 and target values as (m, K) with zeros on padding. Raises before
        any state changes."""
        if self._uninitialised:
            raise RuntimeError(f"{type(self).__name__} was built on the meta device and moved with to_empty(): "
                               "its state is uninitialised memory; call head.reset_weight() or load a state dict first")
        if self._factory["device"].type == "meta":
            raise RuntimeError(f"{type(self).__name__} is on the meta device, which holds no values: move it with "
                               "head.to_empty(device=...), then call head.reset_weight() or load a state dict")
        if not isinstance(H, Tensor) or H.dim() != 2:
            raise ValueError(f"H must be a 2-D tensor (m, {self.hidden_dim}), got "
                             f"{tuple(H.shape) if isinstance(H, Tensor) else type(H).__name__}")
        if H.shape[1] != self.hidden_dim:
            raise ValueError(f"H has {H.shape[1]} columns but the head's hidden_dim is {self.hidden_dim}")
        if H.shape[0] == 0:
            raise ValueError("H has no rows: the minibatch is empty")
        if not H.is_floating_point():
            raise TypeError(f"H must be a floating tensor, got {H.dtype}")
        dtype, device = self._factory["dtype"], self._factory["device"]
        if H.device != device:
            raise ValueError(f"H is on {H.device} but the head is on {device}")
        Hx = H.detach().to(dtype)  # augment(H), written out: the step's one augmentation of H
        if self.bias:
            Hx = torch.cat([Hx, Hx.new_ones(Hx.shape[0], 1)], dim=1)
        if target_idx is None:
            return Hx, None, None
        step = self.training and torch.is_grad_enabled() if step is None else step
        # Non-finite target values pass here: the step is then skipped and counted.
        idx, T, _ = target_slots(target_idx, target_val, H.shape[0], self.num_classes, dtype,
                                 device=device, finite_values=False, ignore_index=self.ignore_index,
                                 check_range=not (self.plan.deferred and step))
        return Hx, idx, T

    def augment(self, H: Tensor) -> Tensor:
        """H in the head's dtype, with the constant bias column appended when bias=True."""
        Hx = H.detach().to(self.dtype)
        if self.bias:
            Hx = torch.cat([Hx, Hx.new_ones(Hx.shape[0], 1)], dim=1)
        return Hx

    # a compiled model calls the head as it is: the step compiles itself (driver.py)
    @torch.compiler.disable(reason=COMPILED_MODEL)
    def forward(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        """The minibatch loss. In training mode with grad enabled, ``loss.backward()``
        gives H its gradient and applies the exact SGD step to the head. A compiled model
        (``torch.compile(model)``) runs the head outside its graphs, and the head's step runs
        compiled itself where it pays (``compile_step``)."""
        with own_math(self._factory["device"].type, self.tf32):  # the head's math in its dtype and precision
            step = self.training and torch.is_grad_enabled()
            # torch marks nn.DataParallel's copies with _is_replica, read from the instance's dict (a
            # module's missing attribute would raise and be caught at every training forward)
            if step and vars(self).get("_is_replica", False):
                raise RuntimeError(
                    f"{type(self).__name__}: nn.DataParallel (the HF Trainer's choice when one process sees several "
                    "GPUs) trains a copy of the head on each GPU, and the head steps itself, so every copy's step "
                    "would be lost: run one process per GPU (torchrun --nproc_per_node <GPUs>, with the head's "
                    "parallel=\"replicated\" or \"sharded\"), or one GPU (CUDA_VISIBLE_DEVICES=0)")
            if self.processes.alone:
                Hx, idx, T = self.prepare(H, target_idx, target_val, step=step)
            else:
                Hx, idx, T = self._prepare_everywhere(H, target_idx, target_val, step=step)
                if self.processes.padded.void:  # this rank's input voids the step: raised at the next read
                    H = self.processes.padded.void_hidden(self, H)
            if not step:
                if torch.is_grad_enabled() and H.requires_grad and self.parallel == "none":
                    return _HeadLoss.apply(H, self, Hx, idx, T, None)  # eval mode: a frozen head
                with torch.no_grad():
                    return self._eval_loss(Hx, idx, T)
            if self._lr * self._weight_decay >= 1:
                self.check_decay()
            if self.driving.step != "autograd":
                return self._step_in_forward(H, Hx, idx, T)
            pending = self.pending
            if pending.hook is not None:  # attached: the checks of its accumulation window
                pending.open(self, H.shape[0])
            if pending.hook is None:
                last = self._open() if self._open is not None else None
                if last is not None and last.dH is None:
                    raise RuntimeError(
                        f"{type(self).__name__}: a second training forward while the last one's loss is still "
                        "alive and has not been backpropagated. The head steps in backward, so each forward needs "
                        "its own backward before the next forward: call backward, or drop (or detach) the old "
                        "loss; to accumulate gradients over several forwards, attach the head to the optimizer "
                        "(head.attach(optimizer)).")
            token = _ForwardToken()
            self._open = weakref.ref(token)
            if not H.requires_grad:
                H = H.detach().requires_grad_()  # a leaf of our own, so that backward reaches the head
            return _HeadLoss.apply(H, self, Hx, idx, T, token)

    # -- when the step is taken: in backward, or at an attached optimizer's step (pending.py) --
    #: the loss scale the backward's gradient carries when no scaler is attached (a user's loop
    #: sets it: ``head.loss_scale = scaler.get_scale()``); the bound on the rows kept between
    #: optimizer steps
    loss_scale = Setting(finite("loss_scale"), "pending.loss_scale")
    max_pending_rows = Setting(positive_int("max_pending_rows"), "pending.max_rows")
    #: Several processes under device flags: the rows each rank may send a training step, at least
    #: (the ranks agree at their first training step on the largest of this and their first
    #: batches' rows, and pad every batch to it: padded_rows.py); None: the first batches' rows.
    #: Set it on every rank before the first step when later batches may hold more rows than the
    #: first (a batch of more voids its step, raised at the next read of the flags).
    rows_per_rank = Setting(positive_int("rows_per_rank", optional=True))

    @property
    def scaler_skips(self) -> int:
        """Steps dropped because the attached GradScaler skipped its step."""
        return self.pending.scaler_skips

    @property
    def attached(self) -> bool:
        """Whether the head steps at an optimizer's step (else in each backward)."""
        return self.pending.hook is not None

    @property
    def pending_rows(self) -> int:
        """Rows kept for the next optimizer step."""
        return self.pending.rows

    def attach(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None,
               max_pending_rows: int | None = None, accumulate: int | None = None) -> None:
        """Step the head at ``optimizer``'s step, with ``scaler``'s scale divided out (and no
        step when the scaler skips). Several backward passes before one optimizer step
        accumulate exactly: one step on all their rows. ``accumulate``: the micro-batches
        of one optimizer step, when the loop knows it; a training forward that finds that
        many kept and no step since raises (a loop that raised inside its window). A wrapper
        holding the torch optimizer as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``,
        Fabric's) is attached through the optimizer it wraps, with its
        ``.scaler`` where ``scaler`` is not given. Call ``detach()`` to undo."""
        self.pending.attach(self, optimizer, scaler, max_pending_rows, accumulate)

    def detach(self) -> None:
        """Step in each backward again; rows kept for a step not taken are dropped."""
        self.pending.detach()

    def discard_pending_step(self) -> None:
        """Drop the rows kept for the next optimizer step: what a loop that skips an optimizer step on
        purpose calls where it zeroes the body's gradients (the head then skips that step too)."""
        self.pending.discard()

    def current_loss_scale(self) -> float:
        """The scale in the backward's gradient: the attached scaler's, else ``loss_scale``."""
        return self.pending.scale()

    def apply_pending_step(self) -> None:
        """The one exact step on every row kept since the last one (the optimizer's step
        hook calls it; a loop may call it itself). Nothing kept: nothing happens."""
        self.pending.apply(self)

    def _warn_loss_factor(self, factor: float) -> None:
        if self.pending.hook is not None:
            self._warn_once("weight", f"{type(self).__name__}: the loss reached the head multiplied by {factor:g} "
                                      "while it waits for the optimizer's step, and the head stepped with that "
                                      "factor. If this is a loss scaler, pass it: head.attach(optimizer, scaler)")
            return
        self._warn_once("weight", f"{type(self).__name__}: the loss reached the head multiplied by {factor:g} and "
                                  "the head stepped with that factor. If this is gradient accumulation or a loss "
                                  "scaler, attach the head to the optimizer for one exact step: head.attach(optimizer, scaler) "
                                  "(in an accelerate loop, the optimizer accelerator.prepare returns); "
                                  "in Lightning, Trainer(callbacks=[HeadSteps()]) with "
                                  "`from lst_lightning.app.callbacks import HeadSteps` (under manual optimization, "
                                  "head.attach(self.optimizers()) in on_train_start)")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    # -- the loss on m-sized tensors ----------------------------------------------------
    def y_sq(self, idx: Tensor, T: Tensor) -> Tensor | None:
        """||y||^2 per row (the squared error only; exact_step.py's ``y_sq``)."""
        return exact_step.y_sq(idx, T) if self.loss_fn.needs_y_sq else None

    def row_weights(self, idx: Tensor, dtype: torch.dtype, rows: Tensor | None = None) -> Tensor:
        """d reduce(per, idx) / d per (m,), as ``reduction`` says (exact_step.py's ``ROW_WEIGHTS``)."""
        return exact_step.ROW_WEIGHTS[self.reduction]((idx >= 0).any(1), dtype, rows)

    def reduce(self, per_example: Tensor, idx: Tensor, weight: Tensor | None = None) -> Tensor:
        """The minibatch loss from per-example losses (exact_step.py's ``reduce``; ``weight``:
        ``row_weights`` already made)."""
        w = self.row_weights(idx, per_example.dtype) if weight is None else weight
        return exact_step.reduce(per_example, w)

    def _skip(self, what: str) -> None:
        """Count a skipped step and warn at the 1st, 2nd, 4th, 8th... so logs are not flooded."""
        self.skipped_nonfinite += 1
        n = int(self.skipped_nonfinite)
        self.step_checks.synced = (self.step_checks.synced[0], n)
        if n & (n - 1) == 0:
            warn(f"{type(self).__name__}: non-finite {what}; the step was skipped and the head's state left "
                 f"untouched ({n} skipped so far)", RuntimeWarning)
