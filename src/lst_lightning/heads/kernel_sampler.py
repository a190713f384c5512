"""Kernel-based proposals (RF-softmax, quadratic): q(c | h) proportional to
K(h, c), drawn through a sum-tree kept in step with the class embeddings."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .kernel_functions import QUADRATIC_ALPHA, Kernel, QuadraticKernel, RandomFourierKernel
from .samplers import Sampler, check_num_samples
from .sum_tree import KernelSumTree

DRAWS = ("auto", "tree", "direct")


def _full_precision(method):
    """Autocast off on the device of the first tensor argument (positional or keyword): the sum-tree's sums and
    the kernel's features stay in the tree's dtype under bf16/fp16 mixed precision."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        dev = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), "cpu")
        with torch.autocast(dev, enabled=False):
            return method(self, *args, **kwargs)
    return wrapped


class KernelSampler(Sampler):
    """``draw``: ``tree`` walks the sum-tree, O(F (2 log n + B)) per draw; ``direct``
    computes the same law for all n classes, O(n F) per row, then draws; ``auto``
    takes the cheaper one for S draws per row."""

    conditional = True
    needs_embeddings = True

    def __init__(self, *, num_classes: int, kernel: Kernel, leaf_size: int = 16, draw: str = "auto"):
        super().__init__()
        if draw not in DRAWS:
            raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
        self.num_classes = num_classes
        self.draw = draw
        self.tree = KernelSumTree(kernel, leaf_size)

    def uses_tree(self, num_samples: int) -> bool:
        if self.draw != "auto":
            return self.draw == "tree"
        return self.num_classes > num_samples * (2 * self.tree.depth + self.tree.leaf_size)

    @_full_precision
    def sync(self, embeddings: Tensor, bias: Tensor | None = None, rows: Tensor | None = None) -> None:
        if rows is None:
            if embeddings.shape[0] != self.num_classes:
                raise ValueError(f"expected embeddings for all {self.num_classes} classes, "
                                 f"got {embeddings.shape[0]} rows")
            self.tree.build(embeddings.detach())
        else:
            self.tree.update(rows, embeddings.detach())

    def _check_hidden(self, hidden: Tensor | None) -> Tensor:
        if hidden is None or hidden.dim() != 2:
            raise ValueError("a conditional sampler needs hidden rows (m, d)")
        if not self.tree.built:
            raise RuntimeError("the sampler has no class embeddings yet: call sync(embeddings) first")
        return hidden.detach()

    def sample(self, num_samples, hidden=None, generator=None):
        ids, log_q = self.sample_float64(num_samples, hidden, generator)
        return ids, log_q.float()

    def log_prob(self, classes, hidden=None):
        return self.log_prob_float64(classes, hidden).float()

    @_full_precision
    def sample_float64(self, num_samples, hidden=None, generator=None) -> tuple[Tensor, Tensor]:
        """``sample`` with log q in float64 (the exact head's correction in its float64 state)."""
        hidden, S = self._check_hidden(hidden), check_num_samples(num_samples)
        if self.uses_tree(S):
            return self.tree.sample(hidden, S, generator)
        probs = self.tree.direct_probs(hidden)
        ids = torch.multinomial(probs, S, replacement=True, generator=generator)
        return ids, probs.gather(1, ids).log()

    @_full_precision
    def log_prob_float64(self, classes, hidden=None) -> Tensor:
        """``log_prob`` in float64."""
        # The walk's law for a few classes is O(K F log n): no need for the direct way here.
        return self.tree.log_prob(self._check_hidden(hidden), classes)

    @_full_precision
    def direct_probs(self, hidden: Tensor) -> Tensor:
        """The same law computed the direct O(n F) way (reference and benchmark)."""
        return self.tree.direct_probs(self._check_hidden(hidden))


class RFFSampler(KernelSampler):
    """RF-softmax proposal: random Fourier features of unit embeddings (D_rff = num_features)."""

    def __init__(self, *, num_classes: int, hidden_dim: int, num_features: int = 256, nu: float = 1.0,
                 leaf_size: int = 16, seed: int | None = 0, draw: str = "auto"):
        super().__init__(num_classes=num_classes, leaf_size=leaf_size, draw=draw,
                         kernel=RandomFourierKernel(hidden_dim, num_features, nu, seed))


class QuadraticSampler(KernelSampler):
    """Quadratic-kernel proposal alpha (h.c)^2 + 1; leaves of about d classes suit its O(d) leaf cost."""

    def __init__(self, *, num_classes: int, hidden_dim: int, alpha: float = QUADRATIC_ALPHA,
                 leaf_size: int | None = None, draw: str = "auto"):
        super().__init__(num_classes=num_classes, kernel=QuadraticKernel(hidden_dim, alpha), draw=draw,
                         leaf_size=max(16, hidden_dim) if leaf_size is None else leaf_size)


class ExactSoftmaxSampler(Sampler):
    """q = the head's own softmax (O(n d) per row): the unbiased reference ("Exp" in Rawat et al.)."""

    conditional = True
    needs_embeddings = True

    def __init__(self, *, num_classes: int):
        super().__init__()
        self.num_classes = num_classes
        self._emb = self._bias = None

    def sync(self, embeddings, bias=None, rows=None):
        if rows is not None:
            raise ValueError("the exact sampler takes all embeddings at once (rows=None)")
        self._emb, self._bias = embeddings.detach(), None if bias is None else bias.detach()

    def _log_q(self, hidden):
        if self._emb is None:
            raise RuntimeError("the sampler has no class embeddings yet: call sync(embeddings) first")
        logits = hidden.detach() @ self._emb.T
        if self._bias is not None:
            logits = logits + self._bias
        return torch.log_softmax(logits.float(), dim=1)

    def sample(self, num_samples, hidden=None, generator=None):
        log_q = self._log_q(hidden)
        ids = torch.multinomial(log_q.exp(), check_num_samples(num_samples), replacement=True,
                                generator=generator)
        return ids, log_q.gather(1, ids)

    def log_prob(self, classes, hidden=None):
        lq = self._log_q(hidden).gather(1, classes.clamp(min=0))
        return torch.where(classes >= 0, lq, torch.zeros_like(lq))
