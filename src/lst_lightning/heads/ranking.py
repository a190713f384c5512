"""Evaluation over all D classes in chunks of classes, so that (m, D) scores are never
held at once: the k best classes, each row's target score, and the count of classes
scoring at or above it (the target's rank)."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


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
