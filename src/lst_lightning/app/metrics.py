"""Evaluation metrics: top-k error rates and MRR from target ranks, perplexity from
log-probabilities, SimLex-999 Spearman correlation of word embeddings, and the
unigram baseline they are compared against."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torchmetrics import Metric

from .run_keys import MRR, topk_error

TOPK = (1, 5, 10, 20, 50, 100)


class RankMetrics(Metric):
    """Accumulates 1-based target ranks: ``top{k}_error`` = P(rank > k), ``mrr`` =
    mean 1/rank. Summed states, so they reduce correctly across processes."""

    full_state_update = False

    def __init__(self, topk: Sequence[int] = TOPK):
        super().__init__()
        self.topk = tuple(topk)
        self.add_state("hits", torch.zeros(len(self.topk), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rr", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, rank: Tensor) -> None:
        rank = rank.reshape(-1)
        ks = torch.tensor(self.topk, device=rank.device)
        self.hits += (rank[None, :] <= ks[:, None]).sum(1).to(self.hits)
        self.rr += (1.0 / rank.double()).sum()
        self.n += rank.numel()

    def compute(self) -> dict[str, Tensor]:
        out = {topk_error(k): 1.0 - self.hits[i] / self.n for i, k in enumerate(self.topk)}
        out[MRR] = self.rr / self.n
        return {k: v.float() for k, v in out.items()}


class WeightedMean(Metric):
    """Mean of per-batch values weighted by their example counts (float64 sums, so
    it reduces across processes exactly like one process over all batches)."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: int | float) -> None:
        self.total += value.double() * weight
        self.n += weight

    def compute(self) -> Tensor:
        return (self.total / self.n).float()


class Perplexity(Metric):
    """exp of the mean negative log-probability of the targets."""

    full_state_update = False

    def __init__(self):
        super().__init__()
        self.add_state("nll", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, log_prob: Tensor) -> None:
        if not torch.isfinite(log_prob).all():
            raise FloatingPointError("the head returned non-finite log-probabilities")
        self.nll -= log_prob.double().sum()
        self.n += log_prob.numel()

    def compute(self) -> Tensor:
        return torch.exp(self.nll / self.n).float()


def unigram_ranks(class_counts: Tensor, targets: Tensor) -> Tensor:
    """Ranks of ``targets`` when every context predicts the training unigram
    distribution (ties count against the target, as in ``OutputHead.target_rank``)."""
    counts = class_counts.to(torch.float64)
    ascending = counts.sort().values
    # number of classes with count >= count[target]
    return len(counts) - torch.searchsorted(ascending, counts[targets], right=False)


def read_simlex(path: str | Path | None = None) -> list[tuple[str, str, float]]:
    """SimLex-999 word pairs and human scores (gensim ships the file)."""
    if path is None:
        from gensim.test.utils import datapath  # noqa: PLC0415

        path = datapath("simlex999.txt")
    pairs = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        a, b, score = line.split("\t")[:3]
        pairs.append((a.lower(), b.lower(), float(score)))
    return pairs


def simlex_spearman(embedding: Tensor, index: dict[str, int], pairs: list[tuple[str, str, float]],
                    skip: set[int] = frozenset()) -> tuple[float, int]:
    """Spearman correlation between cosine similarities of the embeddings and the
    human scores, over the pairs whose two words are in the vocabulary (not ``skip``,
    e.g. ``<unk>``). Returns ``(rho, pairs used)``; rho is NaN under 3 pairs."""
    from scipy.stats import spearmanr  # noqa: PLC0415

    ids = [(index[a], index[b], s) for a, b, s in pairs
           if a in index and b in index and index[a] not in skip and index[b] not in skip]
    if len(ids) < 3:
        return float("nan"), len(ids)
    e = torch.nn.functional.normalize(embedding.detach().float().cpu(), dim=1)
    ia = torch.tensor([i for i, _, _ in ids])
    ib = torch.tensor([j for _, j, _ in ids])
    cos = (e[ia] * e[ib]).sum(1)
    rho = spearmanr(cos.numpy(), [s for _, _, s in ids]).statistic
    return float(rho), len(ids)
