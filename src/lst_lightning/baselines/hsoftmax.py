"""Two-level hierarchical softmax: ``p(y|h) = p(c(y)|h) p(y|c(y), h)``.

Classes (ids sorted by decreasing frequency) are cut into contiguous clusters
by frequency. Training reads, for each target, the cluster softmax (nc
logits) and the softmax inside the target's cluster: O(m (nc + S) d) with S the
largest cluster, against O(m D d).

With ``sparse=True`` (the app's default) training groups the target slots by cluster
and runs one (slots x S_c) matmul per cluster the batch touched, on the rows of those
clusters gathered once; W's and b's gradients hold only those rows (row-sparse, for
``SparseAdam``). ``sparse=False`` is the padded form below (every slot's cluster
gathered to the largest cluster's width, one batched matrix-vector product) with
dense gradients; evaluation and ``log_prob`` use that form in both cases.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lst_kernels as lk

from ..heads.base import OutputHead
from ..heads.samplers import check_class_counts
from .row_sparse import row_gather
from ..heads.targets import check_hidden, check_reduction, check_targets, class_range, in_head_dtype, reduce_rows

BINNINGS = ("equal_size", "equal_mass", "sqrt_mass")


def frequency_bins(num_classes: int, num_clusters: int, binning: str = "equal_size",
                   class_counts: Tensor | None = None) -> Tensor:
    """Cluster boundaries (num_clusters + 1,): cluster c holds ids ``bounds[c]:bounds[c+1]``.

    ``equal_size``: about D / nc classes each. ``equal_mass``: about equal total
    count each. ``sqrt_mass``: about equal total sqrt(count) each (between the two).
    Every cluster gets at least one class.
    """
    if binning not in BINNINGS:
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    if not isinstance(num_clusters, int) or not 1 <= num_clusters <= num_classes:
        raise ValueError(f"num_clusters must be an int in [1, {num_classes}], got {num_clusters!r}")
    if binning == "equal_size":
        w = torch.ones(num_classes, dtype=torch.float64)
    else:
        if class_counts is None:
            raise ValueError(f"binning={binning!r} needs class_counts")
        w = check_class_counts(class_counts, num_classes)
        w = w if binning == "equal_mass" else w.sqrt()
    cum = torch.cumsum(w, 0)
    goals = cum[-1] * torch.arange(1, num_clusters, dtype=torch.float64) / num_clusters
    inner = torch.searchsorted(cum, goals, right=False) + 1  # first id of the next cluster
    bounds = [0]
    for k, b in enumerate(inner.tolist(), start=1):
        # Keep at least one class per cluster on both sides.
        bounds.append(min(max(b, bounds[-1] + 1), num_classes - (num_clusters - k)))
    bounds.append(num_classes)
    return torch.tensor(bounds, dtype=torch.long)


class HierarchicalSoftmaxHead(OutputHead):
    """Two-level softmax over frequency clusters (about sqrt(D) of them by default)."""

    has_log_prob = True

    def __init__(self, num_classes: int, hidden_dim: int, *, class_counts: Tensor | None = None,
                 num_clusters: int | None = None, binning: str = "sqrt_mass", bias: bool = False,
                 init_std: float | None = None, reduction: str = "mean", sparse: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be true or false, got {sparse!r}")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if not isinstance(hidden_dim, int) or hidden_dim < 1:
            raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
        nc = math.ceil(math.sqrt(num_classes)) if num_clusters is None else num_clusters
        bounds = frequency_bins(num_classes, nc, binning, class_counts)
        self.num_classes, self.hidden_dim, self.num_clusters = num_classes, hidden_dim, nc
        self.binning = binning
        self.sparse = sparse
        self.reduction = check_reduction(reduction)
        sizes = bounds[1:] - bounds[:-1]
        self.max_cluster = int(sizes.max())
        self.register_buffer("bounds", bounds.to(device))
        self.register_buffer("cluster_of", torch.repeat_interleave(torch.arange(nc), sizes).to(device))
        std = 1.0 / math.sqrt(hidden_dim) if init_std is None else float(init_std)
        kw = {"dtype": dtype, "device": device}
        self.cluster_weight = nn.Parameter(torch.randn(nc, hidden_dim, **kw) * std)
        self.weight = nn.Parameter(torch.randn(num_classes, hidden_dim, **kw) * std)
        self.cluster_bias = nn.Parameter(torch.zeros(nc, **kw)) if bias else None
        self.bias = nn.Parameter(torch.zeros(num_classes, **kw)) if bias else None

    def sparse_parameters(self) -> list[nn.Parameter]:
        """W and b (their rows): the cluster layer (nc x d) is read whole every step."""
        return [p for p in (self.weight, self.bias) if p is not None] if self.sparse else []

    def cluster_log_prob(self, hidden: Tensor) -> Tensor:
        """log p(cluster | h): (m, nc)."""
        return F.log_softmax(F.linear(hidden, self.cluster_weight, self.cluster_bias).float(), dim=1)

    def _slot_log_prob(self, hidden: Tensor, idx: Tensor) -> Tensor:
        """log p(idx | h) for (m, K) class ids (padding reads class 0)."""
        m, K = idx.shape
        safe = idx.clamp(min=0)
        c = self.cluster_of[safe]  # (m, K)
        lp_cluster = self.cluster_log_prob(hidden).gather(1, c)
        # Members of each target's cluster, padded to the largest cluster.
        first = self.bounds[c].reshape(-1, 1)
        members = first + torch.arange(self.max_cluster, device=idx.device)
        inside = members < self.bounds[c + 1].reshape(-1, 1)
        members = torch.where(inside, members, first)
        rows = self.weight[members]  # (m K, S, d)
        x = hidden.repeat_interleave(K, dim=0).unsqueeze(2)  # (m K, d, 1)
        logits = torch.bmm(rows, x).squeeze(2)
        if self.bias is not None:
            logits = logits + self.bias[members]
        logits = logits.float().masked_fill(~inside, float("-inf"))
        pos = (safe.reshape(-1) - first[:, 0]).unsqueeze(1)
        # torch.logsumexp, as scores() normalises: a target's score and the full scores agree to the bit (ranks)
        lp_within = (logits.gather(1, pos) - torch.logsumexp(logits, dim=1, keepdim=True)).reshape(m, K)
        return lp_cluster + lp_within

    def _grouped_log_prob(self, hidden: Tensor, idx: Tensor) -> Tensor:
        """log p(idx | h) for (m, K) class ids, 0 on padding, by cluster: the real slots
        sorted by their cluster, the rows of the clusters touched gathered once (row-sparse
        gradient with ``sparse``), one matmul and logsumexp per cluster. The work is the
        slots' clusters' rows (O(m S d)), never all D: no padding to the largest cluster."""
        m, K = idx.shape
        flat = idx.reshape(-1)
        slots = (flat >= 0).nonzero().squeeze(1)
        c = self.cluster_of[flat[slots]]
        order = torch.argsort(c, stable=True)
        slots, c = slots[order], c[order]
        touched, per_cluster = torch.unique_consecutive(c, return_counts=True)
        lo = self.bounds[touched]
        sizes = self.bounds[touched + 1] - lo
        offsets = torch.cumsum(sizes, 0) - sizes
        members = torch.repeat_interleave(lo - offsets, sizes) + torch.arange(int(sizes.sum()), device=idx.device)
        w = row_gather(self.weight, members, self.sparse).split(sizes.tolist())
        b = [None] * len(w) if self.bias is None else row_gather(self.bias, members, self.sparse).split(sizes.tolist())
        rows = slots // K
        pos = flat[slots] - torch.repeat_interleave(lo, per_cluster)
        counts = per_cluster.tolist()
        within = [(lg.gather(1, p[:, None]) - lk.logsumexp_rows(lg))[:, 0]
                  for lg, p in ((F.linear(h, wc, bc).float(), p)
                                for h, wc, bc, p in zip(hidden[rows].split(counts), w, b, pos.split(counts)))]
        lp = self.cluster_log_prob(hidden)[rows, c]
        if within:
            lp = lp + torch.cat(within)
        return lp.new_zeros(m * K).index_put((slots,), lp).reshape(m, K)

    def cannot_compile(self) -> str | None:
        if self.sparse:
            return ("its row-sparse step reads the clusters the batch's targets fall in, a number of rows only the "
                    "data knows; a static form pads every target to the largest cluster (head.sparse=false: "
                    f"{self.max_cluster} rows a target, dense gradients)")
        return None

    @in_head_dtype
    def forward(self, hidden: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        idx, val, _ = check_targets(hidden, target_idx, target_val, self.num_classes, self.hidden_dim)
        lp = self._grouped_log_prob(hidden, idx) if self.sparse and self.training else self._slot_log_prob(hidden, idx)
        return reduce_rows(-(val * lp).sum(1), self.reduction)

    @in_head_dtype
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """Exact log p(target | h); same shape as target_idx, 0 on padding slots."""
        idx, _, _ = check_targets(hidden, target_idx, None, self.num_classes, self.hidden_dim)  # as forward's
        lp = self._slot_log_prob(hidden, idx)
        lp = torch.where(idx >= 0, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        return lp.reshape(target_idx.shape)

    @in_head_dtype
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """Exact log p(class | h) for classes ``start:end``: (m, end - start)."""
        check_hidden(hidden, self.hidden_dim, finite=False)
        end = class_range(self.num_classes, start, end)
        c0, c1 = int(self.cluster_of[start]), int(self.cluster_of[end - 1])
        lo, hi = int(self.bounds[c0]), int(self.bounds[c1 + 1])  # whole clusters, for their normalisers
        b = None if self.bias is None else self.bias[lo:hi]
        logits = F.linear(hidden, self.weight[lo:hi], b).float()
        seg = (self.cluster_of[lo:hi] - c0).expand(hidden.shape[0], -1)
        nseg = c1 - c0 + 1
        mx = logits.new_full((hidden.shape[0], nseg), float("-inf")).scatter_reduce(1, seg, logits, "amax")
        tot = logits.new_zeros(hidden.shape[0], nseg).scatter_add(1, seg, (logits - mx.gather(1, seg)).exp())
        lse = mx + tot.log()
        lp = self.cluster_log_prob(hidden)[:, c0:c1 + 1].gather(1, seg) + logits - lse.gather(1, seg)
        return lp[:, start - lo:end - lo]

    @in_head_dtype
    @torch.no_grad()
    def target_score(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        return self._slot_log_prob(hidden, target_idx.reshape(-1, 1))[:, 0]
