"""n-gram windows (context of ``n`` previous tokens -> next token) over tokenised
documents, fetched a whole batch at a time, and a sampler that shuffles per epoch
from ``(seed, epoch)`` so an interrupted run resumes on the same batches."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler


class NgramWindows(Dataset):
    """All windows that fit inside one document. Indexed by a 1-D tensor of example
    ids; returns ``(context (b, n) int64, target (b,) int64)``."""

    def __init__(self, documents: Sequence[Sequence[int]], context_size: int, bos_id: int | None = None):
        if context_size < 1:
            raise ValueError(f"context_size must be >= 1, got {context_size}")
        self.context_size = n = context_size
        pad = [bos_id] * n if bos_id is not None else []
        flat: list[int] = []
        starts: list[Tensor] = []
        longest = 0
        for doc in documents:
            doc = pad + list(doc)
            longest = max(longest, len(doc))
            if len(doc) > n:
                starts.append(torch.arange(len(flat) + n, len(flat) + len(doc)))
            flat += doc
        self.longest_document = longest
        self.tokens = torch.tensor(flat, dtype=torch.long)
        self.targets_at = torch.cat(starts) if starts else torch.empty(0, dtype=torch.long)
        self._offsets = torch.arange(-n, 0)

    def __len__(self) -> int:
        return len(self.targets_at)

    def __getitem__(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        pos = self.targets_at[torch.as_tensor(idx)]
        return self.tokens[pos[:, None] + self._offsets], self.tokens[pos]

    def target_counts(self, num_classes: int) -> Tensor:
        return torch.bincount(self.tokens[self.targets_at], minlength=num_classes)


class EpochBatchSampler(Sampler[Tensor]):
    """Batches of example ids, reshuffled each epoch from ``(seed, epoch)`` alone, and
    sharded by rank for multi-process runs (Lightning calls ``set_epoch``)."""

    def __init__(self, size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, limit: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.limit = limit
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _ids(self) -> Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            ids = torch.randperm(self.size, generator=g)
        elif self.limit is not None and self.limit < self.size:
            # Evenly spread subset, so a capped evaluation still sees every document.
            ids = torch.linspace(0, self.size - 1, self.limit).round().long()
        else:
            ids = torch.arange(self.size)
        if self.limit is not None:
            ids = ids[: self.limit]
        return ids[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[Tensor]:
        ids = self._ids()
        stop = len(ids) - len(ids) % self.batch_size if self.drop_last else len(ids)
        for i in range(0, stop, self.batch_size):
            yield ids[i : i + self.batch_size]

    def __len__(self) -> int:
        n = len(self._ids())
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
