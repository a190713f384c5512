"""What the factored head and its naive reference share: the constructor, input
validation, the loss and its gradients on m-sized tensors, the learning rate,
and the autograd function that applies the head's own SGD step in backward.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch
from torch import Tensor

from ..heads.base import OutputHead
from ..heads.targets import IGNORE_INDEX, target_slots
from ..losses import SphericalLoss, make_loss
from .blocks import BLOCK
from .multi_process import Sharding
from .pending_step import PendingSteps

STATE_DTYPES = (torch.float32, torch.float64)
#: "mean": over all m rows (padded rows count, adding 0); "mean_real": over the rows with at
#: least one real target (as F.cross_entropy with ignore_index); "sum".
REDUCTIONS = ("mean", "mean_real", "sum")


def own_precision(method):
    """Run a head method with autocast off on the head's device: the head does its math in
    its state dtype whatever autocast context (bf16/fp16 mixed precision) the caller is in."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with torch.autocast(self.device.type, enabled=False):
            return method(self, *args, **kwargs)
    return wrapped


class _SelfUpdatingStep(torch.autograd.Function):
    """Returns the loss in forward; in backward, returns dL/dH and lets the head
    apply its SGD step with the gradients of this very forward."""

    @staticmethod
    def forward(ctx, H: Tensor, head: "SphericalHeadBase", idx: Tensor, T: Tensor, token):
        Hx, idx, T, ctx.rows = head.sharding.collect(head.augment(H), idx, T, training=True)
        loss, saved = head._forward_step(Hx, idx, T)
        # token None: a frozen head (eval mode), which hands dL/dH on and never steps.
        ctx.head, ctx.saved, ctx.version, ctx.token = head, saved, head._version, token
        ctx.in_dtype = H.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        with torch.autocast(ctx.head.device.type, enabled=False):
            return _SelfUpdatingStep._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        head = ctx.head
        dH = head.sharding.own_rows(head._backward_of(ctx.saved, ctx.token, ctx.version, grad_out.to(head.dtype)),
                                    ctx.rows)
        if ctx.token is not None:
            ctx.saved = None  # a second backward reuses the token's dL/dH
        return dH[:, : head.hidden_dim].to(ctx.in_dtype), None, None, None, None


def _move_keeping_dtype(fn, device: torch.device, t: Tensor) -> Tensor:
    """``fn``'s move of a tensor with its device change only, for floating tensors."""
    return t.to(device=device) if t.is_floating_point() else fn(t)


class SphericalHeadBase(PendingSteps, OutputHead):
    """A self-updating head with a spherical loss; subclasses hold W explicitly or factored."""

    self_updating = True

    def __init__(self, num_classes: int, hidden_dim: int, loss: str | SphericalLoss = "zloss",
                 loss_kwargs: dict | None = None, lr: float | None = None, weight_decay: float = 0.0,
                 bias: bool = False, reduction: str = "mean", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, init_std: float | None = None,
                 generator: torch.Generator | None = None, ignore_index: int = IGNORE_INDEX):
        super().__init__()
        if not (isinstance(num_classes, int) and num_classes >= 1):
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not (isinstance(hidden_dim, int) and hidden_dim >= 1):
            raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or 0 <= ignore_index < num_classes:
            raise ValueError(f"ignore_index must be an int outside the class ids [0, {num_classes}) "
                             f"(default {IGNORE_INDEX}), got {ignore_index!r}")
        self.ignore_index = ignore_index
        if dtype not in STATE_DTYPES:
            raise TypeError(f"the head keeps its state in float32 or float64, got {dtype}")
        self.num_classes, self.hidden_dim = num_classes, hidden_dim
        self.bias, self.reduction = bool(bias), reduction
        #: columns of the implicit W: the hidden size, plus one constant column for the bias.
        self.width = hidden_dim + int(self.bias)
        self.loss_fn = loss if isinstance(loss, SphericalLoss) else make_loss(loss, **(loss_kwargs or {}))
        self.has_log_prob = self.loss_fn.normalised
        self.lr = lr if lr is not None else self.loss_fn.default_lr  # the loss's own (Z-loss: 1.0)
        self.weight_decay = weight_decay
        self._version = 0  # bumped by every change of state: guards stale backward calls
        self._uninitialised = False  # moved off the meta device: no state until reset_weight()
        self._factory = {"dtype": dtype, "device": torch.device(device) if device is not None else None}
        self._init_pending_steps()
        #: the process-group work (multi_process.py): one process, every collective the
        #: identity (the factored head holds a replicated or sharded one with ``parallel``)
        self.sharding = Sharding(num_classes)
        # The seed of the initial W (drawn on the host, so that a head built on the meta
        # device has one too): ``reset_weight()`` redraws the same W from it.
        number = isinstance(init_std, (int, float)) and not isinstance(init_std, bool)
        if init_std is not None and not (number and math.isfinite(init_std) and init_std > 0):
            raise ValueError(f"init_std must be a finite number > 0 or None (the loss's rule), got {init_std!r}")
        # the loss's choice by default (docs/learning_at_scale.md)
        self._init_std = float(init_std) if init_std is not None else self.loss_fn.init_std(num_classes, self.width)
        self._init_seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator,
                                            device=generator.device if generator is not None else "cpu"))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's state (float32 or float64): it follows ``.double()``, ``.float()``
        and ``.to(dtype)``; the head computes in it whatever the dtype of H or the autocast context."""
        return self._factory["dtype"]

    def _apply(self, fn, recurse=True):
        # Every dtype/device move (.double(), .to(), .half(), .cuda(), to_empty()) comes here.
        # The state follows a move to float32/float64; half precision would make the exact
        # step too coarse, so the state stays as it is then (moved to the new device only).
        was_meta = self.device.type == "meta"
        probe = fn(torch.zeros((), dtype=self.dtype, device=self.device))
        if probe.dtype not in STATE_DTYPES:
            warnings.warn(f"{type(self).__name__} keeps its state in {self.dtype}, not {probe.dtype}: it takes "
                          "H in any float dtype and returns dL/dH in H's dtype (docs/factored_head.md, "
                          "'Precision, padding and dtype')", UserWarning, stacklevel=3)
            fn = functools.partial(_move_keeping_dtype, fn, probe.device)
        out = super()._apply(fn, recurse)
        self._factory["dtype"], self._factory["device"] = probe.dtype if probe.dtype in STATE_DTYPES \
            else self.dtype, probe.device
        self._uninitialised |= was_meta and probe.device.type != "meta"  # to_empty(): uninitialised memory
        self._graph = None  # a captured CUDA graph holds the old tensors
        self._version += 1  # a pending backward from before the move is stale
        return out
    # -- hyperparameters the training loop may change ---------------------------------
    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"lr must be finite and positive, got {value}")
        self._lr = value

    @property
    def weight_decay(self) -> float:
        return self._weight_decay

    @weight_decay.setter
    def weight_decay(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"weight_decay must be finite and >= 0, got {value}")
        self._weight_decay = value

    def get_extra_state(self):
        return {"lr": self._lr, "weight_decay": self._weight_decay,
                "loss": {"name": self.loss_fn.name, **self.loss_fn.hparams()}}

    def set_extra_state(self, state) -> None:
        self.lr, self.weight_decay = state["lr"], state["weight_decay"]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Refuse a state saved with another loss before any buffer is overwritten.
        saved = state_dict.get(prefix + "_extra_state", {}).get("loss")
        mine = {"name": self.loss_fn.name, **self.loss_fn.hparams()}
        if saved is not None and saved != mine:
            raise ValueError(f"the state was saved with loss {saved} but this head has {mine}")
        self._version += 1
        self._uninitialised = False
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, hidden_dim={self.hidden_dim}, loss={self.loss_fn.name}, "
                f"lr={self.lr}, weight_decay={self.weight_decay}, bias={self.bias}, reduction={self.reduction}, "
                f"ignore_index={self.ignore_index}")

    # -- what subclasses provide --------------------------------------------------------
    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def _forward_step(self, Hx: Tensor, idx: Tensor, T: Tensor) -> tuple[Tensor, object]:
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

    def _eval_loss(self, Hx: Tensor, idx: Tensor, T: Tensor) -> Tensor:
        raise NotImplementedError

    def _ensure_distributed(self) -> None:
        if not self.sharding.joined:
            self.distribute()

    def _prepare_everywhere(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None,
                            step: bool | None = None):
        """``prepare``, agreed on by every rank: one rank's bad input raises on all of them."""
        self._ensure_distributed()
        step = self.in_training_step if step is None else step
        return self.sharding.agree(lambda: self.prepare(H, target_idx, target_val, step=step), step, self.device)

    def weight(self) -> Tensor:
        """The implicit W, materialised: (D, d), or (D, d + 1) with bias."""
        raise NotImplementedError

    def reset_weight(self, W: Tensor | None = None) -> None:
        """Make the implicit W equal to W; without W, the head as constructed (its initial W
        from its seed, every counter zero): the way to finish a head built on the meta
        device, after ``to_empty()``."""
        raise NotImplementedError

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
        return None  # attach() makes it step at the optimizer's step (pending_step.py)

    @property
    def in_training_step(self) -> bool:
        """Whether a forward now is a training step (the head updates itself in backward)."""
        return self.training and torch.is_grad_enabled()

    def check_decay(self) -> None:
        """Refuse lr * weight_decay >= 1: the decay factor 1 - lr wd would flip or zero W."""
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"lr * weight_decay = {self.lr * self.weight_decay} >= 1: the decay would flip W")

    # -- input handling -----------------------------------------------------------------
    def prepare(self, H: Tensor, target_idx: Tensor | None = None, target_val: Tensor | None = None,
                step: bool | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Validate inputs; return H with the bias column in the head's dtype, idx as (m, K)
        int64 and target values as (m, K) with zeros on padding. Raises before any state changes."""
        if self._uninitialised:
            raise RuntimeError(f"{type(self).__name__} was built on the meta device and moved with to_empty(): "
                               "its state is uninitialised memory; call head.reset_weight() or load a state dict first")
        if not isinstance(H, Tensor) or H.dim() != 2:
            raise ValueError(f"H must be a 2-D tensor (m, {self.hidden_dim}), got "
                             f"{tuple(H.shape) if isinstance(H, Tensor) else type(H).__name__}")
        if H.shape[1] != self.hidden_dim:
            raise ValueError(f"H has {H.shape[1]} columns but the head's hidden_dim is {self.hidden_dim}")
        if H.shape[0] == 0:
            raise ValueError("H has no rows: the minibatch is empty")
        if not H.is_floating_point():
            raise TypeError(f"H must be a floating tensor, got {H.dtype}")
        if H.device != self.device:
            raise ValueError(f"H is on {H.device} but the head is on {self.device}")
        Hx = self.augment(H)
        step = self.in_training_step if step is None else step
        if target_idx is None:
            return Hx, None, None
        # Non-finite target values pass here: the step is then skipped and counted.
        idx, T, _ = target_slots(target_idx, target_val, H.shape[0], self.num_classes, self.dtype,
                                 device=self.device, finite_values=False, ignore_index=self.ignore_index,
                                 check_range=not (self.deferred_checks and step))
        return Hx, idx, T

    def augment(self, H: Tensor) -> Tensor:
        """H in the head's dtype, with the constant bias column appended when bias=True."""
        Hx = H.detach().to(self.dtype)
        if self.bias:
            Hx = torch.cat([Hx, Hx.new_ones(Hx.shape[0], 1)], dim=1)
        return Hx

    @own_precision
    def forward(self, H: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        """The minibatch loss. In training mode with grad enabled, ``loss.backward()``
        gives H its gradient and applies the exact SGD step to the head."""
        Hx, idx, T = self._prepare_everywhere(H, target_idx, target_val)
        if not self.in_training_step:
            if torch.is_grad_enabled() and H.requires_grad and self.parallel == "none":
                return _SelfUpdatingStep.apply(H, self, idx, T, None)  # eval mode: a frozen head
            with torch.no_grad():
                return self._eval_loss(Hx, idx, T)
        self.check_decay()
        return self._training_loss(H, idx, T)

    def _training_loss(self, H: Tensor, idx: Tensor, T: Tensor) -> Tensor:
        """The loss of a training step on checked targets; the step is taken in its backward."""
        token = self._open_forward(H.shape[0])
        if not H.requires_grad:
            H = H.detach().requires_grad_()  # a leaf of our own, so that backward reaches the head
        return _SelfUpdatingStep.apply(H, self, idx, T, token)

    # -- the loss on m-sized tensors ----------------------------------------------------
    def y_sq(self, idx: Tensor, T: Tensor) -> Tensor | None:
        """||y||^2 per row, with repeated classes in a row summed first (squared error only)."""
        if self.loss_fn.name != "mse":
            return None
        same = (idx[:, :, None] == idx[:, None, :]) & (idx[:, :, None] >= 0)
        return (T[:, :, None] * T[:, None, :] * same).sum((1, 2))

    def reduce(self, per_example: Tensor, idx: Tensor) -> Tensor:
        """The minibatch loss from per-example losses; a fully padded row (every slot -1)
        contributes nothing, for every loss (the squared error would see a zero target)."""
        real = (idx >= 0).any(1)
        total = torch.where(real, per_example, torch.zeros((), dtype=per_example.dtype, device=real.device)).sum()
        if self.reduction == "sum":
            return total
        n = real.sum().clamp_min(1) if self.reduction == "mean_real" else per_example.shape[0]
        return total / n

    def loss_and_grads(self, q: Tensor, s: Tensor, A: Tensor, T: Tensor, y_sq: Tensor | None, idx: Tensor):
        """The minibatch loss and its gradients dL/dq (m), dL/ds (m), dL/dA (m, K), by autograd."""
        with torch.enable_grad():
            q, s, A = (t.detach().requires_grad_() for t in (q, s, A))
            L = self.reduce(self.loss_fn(q, s, A, T, num_classes=self.num_classes, y_sq=y_sq), idx)
            gq, gs, GA = torch.autograd.grad(L, (q, s, A), materialize_grads=True)  # mse ignores s
        return L.detach(), gq, gs, GA

    # -- non-finite values ----------------------------------------------------------------
    def _register_buffers_common(self) -> None:
        # On the head's device: the sync-free step adds device flags to them.
        dev = self._factory["device"]
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=dev))
        self.register_buffer("skipped_nonfinite", torch.zeros((), dtype=torch.long, device=dev))

    def _zero_counters(self) -> None:
        """Every long counter buffer (steps, skips, repairs) back to 0."""
        for buf in self.buffers(recurse=False):
            if buf.dtype == torch.long:
                buf.zero_()

    def _skip(self, what: str) -> None:
        """Count a skipped step and warn at the 1st, 2nd, 4th, 8th... so logs are not flooded."""
        self.skipped_nonfinite += 1
        n = int(self.skipped_nonfinite)
        if n & (n - 1) == 0:
            warnings.warn(f"{type(self).__name__}: non-finite {what}; the step was skipped and the head's "
                          f"state left untouched ({n} skipped so far)", RuntimeWarning, stacklevel=3)
