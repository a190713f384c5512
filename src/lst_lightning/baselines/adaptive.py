"""Adaptive softmax (Grave et al.): torch's ``nn.AdaptiveLogSoftmaxWithLoss``
behind the head interface. Frequent classes (a shortlist) sit in the head
softmax; rarer ones in tail clusters of reduced width ``d / div_value^i``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads.base import OutputHead
from ..heads.targets import check_hidden, check_reduction, check_targets, class_range, in_head_dtype, reduce_rows


def resolve_cutoffs(cutoffs: Sequence[int | float], num_classes: int) -> list[int]:
    """Absolute cutoffs from ints (class ids) or floats in (0, 1) (fractions of D).

    They must be strictly increasing and inside (0, D): the first is the
    shortlist size, each later one ends a tail cluster.
    """
    if isinstance(cutoffs, (str, bytes)) or not isinstance(cutoffs, Sequence) or len(cutoffs) == 0:
        raise ValueError(f"cutoffs must be a non-empty list of ints or fractions, got {cutoffs!r}")
    out = []
    for c in cutoffs:
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            raise TypeError(f"cutoffs must hold ints or floats, got {c!r}")
        if isinstance(c, float):
            if not 0.0 < c < 1.0:
                raise ValueError(f"a float cutoff is a fraction of num_classes in (0, 1), got {c}")
            c = round(c * num_classes)
        out.append(int(c))
    if any(b <= a for a, b in zip(out, out[1:])) or out[0] <= 0 or out[-1] >= num_classes:
        raise ValueError(f"cutoffs must be strictly increasing in (0, {num_classes}); "
                         f"got {list(cutoffs)} -> {out}")
    return out


class AdaptiveSoftmaxHead(OutputHead):
    """Adaptive softmax; ``cutoffs`` are class ids or fractions of D (ids sorted by frequency)."""

    has_log_prob = True

    def __init__(self, num_classes: int, hidden_dim: int, *, cutoffs: Sequence[int | float] = (0.05, 0.25),
                 div_value: float = 4.0, head_bias: bool = False, reduction: str = "mean",
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 3:
            raise ValueError(f"num_classes must be an int >= 3 (a shortlist and a tail), got {num_classes!r}")
        if not isinstance(hidden_dim, int) or hidden_dim < 1:
            raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
        if not div_value >= 1.0:
            raise ValueError(f"div_value must be >= 1, got {div_value}")
        self.num_classes, self.hidden_dim = num_classes, hidden_dim
        self.cutoffs = resolve_cutoffs(cutoffs, num_classes)
        self.reduction = check_reduction(reduction)
        n_tails = len(self.cutoffs)
        if int(hidden_dim // div_value**n_tails) < 1:
            raise ValueError(f"the last tail cluster would have width hidden_dim // div_value^{n_tails} = 0 "
                             f"(hidden_dim={hidden_dim}, div_value={div_value}); use fewer cutoffs or a "
                             "smaller div_value")
        self.asm = nn.AdaptiveLogSoftmaxWithLoss(hidden_dim, num_classes, self.cutoffs, div_value=div_value,
                                                 head_bias=head_bias, dtype=dtype, device=device)

    def _target_log_prob(self, hidden: Tensor, idx: Tensor) -> Tensor:
        """log p of each real slot of (m, K) ids; 0 on padding."""
        m, K = idx.shape
        valid = idx >= 0
        lp = torch.zeros(m, K, dtype=torch.float32, device=hidden.device)
        if valid.any():
            rows = hidden.repeat_interleave(K, dim=0)[valid.reshape(-1)]
            out = self.asm(rows, idx[valid]).output.float()
            lp = lp.masked_scatter(valid, out)
        return lp

    def cannot_compile(self) -> str | None:
        return ("nn.AdaptiveLogSoftmaxWithLoss picks each tail cluster's rows by their targets (nonzero: a size "
                "only the data knows); a static form would score every tail for every row")

    @in_head_dtype
    def forward(self, hidden: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        idx, val, _ = check_targets(hidden, target_idx, target_val, self.num_classes, self.hidden_dim)
        per_row = -(val * self._target_log_prob(hidden, idx)).sum(1)
        return reduce_rows(per_row + 0.0 * hidden.sum(), self.reduction)  # keeps a graph when all padding

    @in_head_dtype
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        idx, _, _ = check_targets(hidden, target_idx, None, self.num_classes, self.hidden_dim)  # as forward's
        return self._target_log_prob(hidden, idx).reshape(target_idx.shape)

    @in_head_dtype
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """Exact log p(class | h) for classes ``start:end``, computing only the clusters it touches."""
        check_hidden(hidden, self.hidden_dim, finite=False)
        end = class_range(self.num_classes, start, end)
        head_lp = F.log_softmax(self.asm.head(hidden).float(), dim=1)
        edges = [0, *self.cutoffs, self.num_classes]
        parts = []
        for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            if i == 0:
                parts.append(head_lp[:, a:b])
            else:
                tail_lp = F.log_softmax(self.asm.tail[i - 1](hidden).float(), dim=1)
                parts.append(head_lp[:, self.cutoffs[0] + i - 1, None] + tail_lp[:, a - lo:b - lo])
        return torch.cat(parts, 1)

    @in_head_dtype
    @torch.no_grad()
    def target_score(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        return self._target_log_prob(hidden, target_idx.reshape(-1, 1))[:, 0]
