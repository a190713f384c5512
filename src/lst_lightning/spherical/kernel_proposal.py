"""The quadratic proposal of the exact head's sampled classes (docs/algorithm.md, "Sampled
classes"): q(c | h) proportional to alpha (h.w_c)^2 + 1 on the implicit W = V U + 1 omega^T, drawn
per row through a sum-tree (heads/sum_tree.py) kept on the host, in the head's dtype, beside the
generator it draws with.

The factored head's tree is over the rows z_c = [v_c, 1], its query per row [U h, h.omega]
(h.w_c = (U h).v_c + h.omega): a step moves only the leaves of the rows it wrote (``moved``, after
the write); whatever else moves the state (a fold or a singular-value fix, a load, a reset, a move)
bumps the head's version, and the next draw rebuilds the tree (O(D d^2)). The naive head's tree is
over its rows w_c, its query h (the same law), rebuilt at each draw: its every step moves all of W.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..heads.kernel_sampler import QuadraticSampler


class KernelProposal:
    """``head.negatives.kernel``: the sum-tree over the head's rows (``head._proposal_rows``)."""

    def __init__(self, num_classes: int, alpha: float, leaf_size: int | None):
        self.num_classes, self.alpha, self.leaf_size = num_classes, alpha, leaf_size
        self.sampler = None  # made at the first build, for the width of the head's rows
        self.synced = None  # the head's version (``_version``) the tree holds
        self.builds = 0  # whole builds (the factored head: the first, then one per repair or load)

    def sync(self, head) -> None:
        """Rebuild the tree from all the head's rows unless it holds the head's state."""
        if self.synced == head._version:
            return
        rows = head._proposal_rows().detach().to("cpu")
        if self.sampler is None or self.sampler.tree.kernel.feature_dim != rows.shape[1] ** 2 + 1:
            # one leaf size for both heads: the quadratic sampler's rule for the factored head's rows
            leaf = max(16, head.width + 1) if self.leaf_size is None else self.leaf_size
            self.sampler = QuadraticSampler(num_classes=self.num_classes, hidden_dim=rows.shape[1],
                                            alpha=self.alpha, leaf_size=leaf)
        self.sampler.sync(rows)
        self.builds += 1
        self.synced = head._version

    def moved(self, head, idx: Tensor | None) -> None:
        """After the write: the leaves of the rows it scattered into (``idx``, -1 padding);
        None (a fold moved all of V): rebuilt at the next draw."""
        if self.synced is None or idx is None:
            self.synced = None
            return
        rows = torch.unique(idx[idx >= 0])
        self.sampler.sync(head._proposal_rows(rows).detach().to("cpu"), rows=rows.cpu())
        self.synced = head._version

    def sample(self, query: Tensor, num: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(m, num) classes drawn for each row's query, and their log q, on the host, from the tree as
        the last ``sync`` left it (the draw's host part: ``NegativeSampling.uniforms``)."""
        return self.sampler.sample_float64(num, query.detach().to("cpu"), generator=generator)

    def log_q(self, query: Tensor, idx: Tensor) -> Tensor:
        """log q of each row's classes ``idx`` (m, K) under that row's law (0 on padding), on the host."""
        return self.sampler.log_prob_float64(idx.to("cpu"), query.detach().to("cpu"))
