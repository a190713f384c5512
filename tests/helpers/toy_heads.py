"""Throwaway heads for testing the app before (and independently of) the real ones:
an ordinary softmax head and a self-updating explicit squared-error head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lst_lightning.heads.base import OutputHead


class ToySoftmaxHead(OutputHead):
    has_log_prob = True

    def __init__(self, num_classes: int, hidden_dim: int, class_counts: Tensor | None = None, **_):
        super().__init__()
        self.num_classes, self.hidden_dim = num_classes, hidden_dim
        self.proj = nn.Linear(hidden_dim, num_classes)
        self.saw_counts = class_counts is not None

    def forward(self, hidden, target_idx, target_val=None):
        return F.cross_entropy(self.proj(hidden), target_idx.reshape(-1))

    def scores(self, hidden, start=0, end=None):
        return F.linear(hidden, self.proj.weight[start:end], self.proj.bias[start:end])

    def log_prob(self, hidden, target_idx):
        return self.proj(hidden).log_softmax(-1).gather(1, target_idx.reshape(-1, 1)).squeeze(1)


class _SelfUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, head):
        out = hidden @ weight.T
        y = torch.zeros_like(out)
        y[torch.arange(len(target)), target] = 1.0
        ctx.save_for_backward(hidden, out - y)
        ctx.head = head
        return ((out - y) ** 2).sum(1).mean()

    @staticmethod
    def backward(ctx, g):
        hidden, resid = ctx.saved_tensors
        d_out = g * 2 * resid / len(hidden)
        d_hidden = d_out @ ctx.head.weight
        ctx.head.weight -= ctx.head.lr * d_out.T @ hidden  # the head's own SGD step
        return d_hidden, None, None, None


class ToySelfUpdatingHead(OutputHead):
    """Explicit W (a buffer) updated by SGD inside backward; squared error."""

    self_updating = True

    def __init__(self, num_classes: int, hidden_dim: int, lr: float = 0.01, **_):
        super().__init__()
        self.num_classes, self.hidden_dim, self.lr = num_classes, hidden_dim, lr
        self.register_buffer("weight", torch.randn(num_classes, hidden_dim) * 0.01)

    def forward(self, hidden, target_idx, target_val=None):
        return _SelfUpdate.apply(hidden, self.weight, target_idx.reshape(-1), self)

    def scores(self, hidden, start=0, end=None):
        return hidden @ self.weight[start:end].T

    def stats(self):
        return {"weight_norm": self.weight.norm().item()}


def _all_gather_rows(x: Tensor) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts)


class _ReplicatedUpdate(torch.autograd.Function):
    """The global-batch squared error: every rank gathers all rows, applies the same
    global SGD step, and returns world x dL/dH for its own rows (DDP averages)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, head):
        world, rank, m = head.world, head.rank, len(hidden)
        H = _all_gather_rows(hidden) if world > 1 else hidden
        T = _all_gather_rows(target) if world > 1 else target
        resid = H @ weight.T
        resid[torch.arange(len(T)), T] -= 1.0
        ctx.save_for_backward(H, resid)
        ctx.head, ctx.rows = head, slice(rank * m, (rank + 1) * m)
        return (resid**2).sum(1).mean()

    @staticmethod
    def backward(ctx, g):
        H, resid = ctx.saved_tensors
        head = ctx.head
        d_out = g * 2 * resid / len(H)
        d_hidden = head.world * (d_out[ctx.rows] @ head.weight)
        head.weight -= head.lr * d_out.T @ H
        return d_hidden, None, None, None


class ToyReplicatedHead(ToySelfUpdatingHead):
    """A self-updating head with a ``replicated`` multi-process mode, to test the app's
    plumbing (``distribute`` in setup, buffers DDP must not broadcast) apart from the
    factored head. ``rank_marker`` is set to the rank on purpose: it must stay so."""

    parallel_modes = ("replicated",)
    parallel = "replicated"

    def __init__(self, num_classes: int, hidden_dim: int, lr: float = 0.01, **_):
        super().__init__(num_classes, hidden_dim, lr)
        self.register_buffer("rank_marker", torch.zeros(()))
        self.world, self.rank = 1, 0

    def distribute(self, process_group=None):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.world, self.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        self.rank_marker.fill_(self.rank)

    def forward(self, hidden, target_idx, target_val=None):
        target = target_idx.reshape(-1)
        if not torch.is_grad_enabled():  # evaluation: local rows only
            resid = hidden @ self.weight.T
            resid[torch.arange(len(target)), target.clamp(min=0)] -= 1.0
            return (resid**2).sum(1).mean()
        return _ReplicatedUpdate.apply(hidden, self.weight, target, self)
