"""The interface every output head implements, so that one LightningModule can
train and evaluate any of them.

A head maps the body's last hidden layer ``H`` (m, d) and targets to a scalar
training loss, and gives full-vocabulary scores (in chunks of classes) for
top-k error rates and ranks. Two kinds exist:

- self-updating heads (``self_updating = True``: the factored and naive
  spherical heads) apply their own exact SGD step inside ``loss.backward()``
  and hold no ``nn.Parameter``; the training loop sets ``head.lr`` each step;
- ordinary heads (softmax, hierarchical, adaptive, sampled) hold parameters
  that the optimizer trains.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn


def topk_of_chunks(chunks: Iterator[tuple[int, Tensor]], k: int) -> tuple[Tensor, Tensor]:
    """The k best (score, class id) of each row over chunks of scores (start, (m, n))."""
    best = ids = None
    for start, sc in chunks:
        cols = torch.arange(start, start + sc.shape[1], device=sc.device).expand_as(sc)
        if best is not None:
            sc, cols = torch.cat([best, sc], 1), torch.cat([ids, cols], 1)
        best, pos = sc.topk(min(k, sc.shape[1]), dim=1)
        ids = cols.gather(1, pos)
    return best, ids


def _in_chunk(target_idx: Tensor, start: int, width: int) -> Tensor:
    """The rows whose target class lies in the chunk of classes [start, start + width)."""
    return ((target_idx >= start) & (target_idx < start + width)).nonzero().squeeze(1)


def target_scores_of_chunks(chunks: Iterator[tuple[int, Tensor]], target_idx: Tensor) -> Tensor:
    """Each row's score of its target class (target_idx (m,)), picked from chunks of
    scores; 0 where the target is in none of them (padding, or another shard's class)."""
    out = None
    for start, sc in chunks:
        out = sc.new_zeros(target_idx.shape[0]) if out is None else out
        rows = _in_chunk(target_idx, start, sc.shape[1])
        out[rows] = sc[rows, target_idx[rows] - start]
    return out


def count_at_or_above(chunks: Iterator[tuple[int, Tensor]], target_idx: Tensor, target: Tensor) -> Tensor:
    """Per row, the classes of the chunks scoring >= the target's score, its own column left out."""
    count = torch.zeros(target_idx.shape[0], dtype=torch.long, device=target_idx.device)
    for start, sc in chunks:
        ge = sc >= target[:, None].to(sc.dtype)
        rows = _in_chunk(target_idx, start, sc.shape[1])
        ge[rows, target_idx[rows] - start] = False
        count += ge.sum(1)
    return count


class OutputHead(nn.Module):
    """Base class of all output heads."""

    #: True when the head updates itself in backward (no optimizer parameters).
    self_updating: bool = False
    #: True when ``log_prob`` gives normalised log-probabilities (perplexity).
    has_log_prob: bool = False

    num_classes: int
    hidden_dim: int

    def forward(self, hidden: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        """The training loss (a scalar)."""
        raise NotImplementedError

    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """Scores of classes ``start:end`` for each row of ``hidden``: (m, end - start).

        Higher is more likely; used for top-k error rates and ranks.
        """
        raise NotImplementedError

    def score_chunks(self, hidden: Tensor, chunk_size: int = 65536) -> Iterator[tuple[int, Tensor]]:
        """Full-vocabulary scores in chunks of classes: yields (start, scores)."""
        for start in range(0, self.num_classes, chunk_size):
            end = min(start + chunk_size, self.num_classes)
            yield start, self.scores(hidden, start, end)

    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """log p(target | hidden), shape (m,), for heads that define probabilities."""
        raise NotImplementedError(f"{type(self).__name__} defines no normalised probabilities")

    @torch.no_grad()
    def target_score(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """The score of each row's target class, (m,). Heads may override this with a gather."""
        return target_scores_of_chunks(self.score_chunks(hidden), target_idx.reshape(-1))

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """The k best classes of each row, best first: (scores, class ids), (m, k) each."""
        return topk_of_chunks(self.score_chunks(hidden, chunk_size), k)

    @torch.no_grad()
    def target_rank(self, hidden: Tensor, target_idx: Tensor, chunk_size: int = 65536) -> Tensor:
        """1-based rank of each row's target among all classes, (m,).

        Ties count against the target (a constant scorer ranks it last, not first), and
        the target's own column is left out, so the rounding of its score cannot move it.
        Scores are made in chunks of classes: (m, D) is never held at once.
        """
        target_idx = target_idx.reshape(-1)
        target = self.target_score(hidden, target_idx)
        return 1 + count_at_or_above(self.score_chunks(hidden, chunk_size), target_idx, target)
