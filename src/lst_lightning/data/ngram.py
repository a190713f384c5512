"""n-gram windows (context of ``n`` previous tokens -> next token) over tokenised
documents, fetched a whole batch at a time, and a sampler that shuffles per epoch
from ``(seed, epoch)`` so an interrupted run resumes on the same batches."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from .flat import FlatDocuments


class NgramWindows(Dataset):
    """All windows that fit inside one document. Indexed by a 1-D tensor of example
    ids; returns ``(context (b, n) int64, target (b,) int64)``. ``documents``: lists of
    ids, or :class:`~lst_lightning.data.flat.FlatDocuments` (a corpus of 10^8 tokens)."""

    def __init__(self, documents: Sequence[Sequence[int]] | FlatDocuments, context_size: int,
                 bos_id: int | None = None):
        if context_size < 1:
            raise ValueError(f"context_size must be >= 1, got {context_size}")
        self.context_size = n = context_size
        if not isinstance(documents, FlatDocuments):
            documents = FlatDocuments.from_lists(documents)
        flat = documents.with_heads(n, bos_id)
        self.longest_document = flat.longest
        self.tokens = torch.from_numpy(flat.tokens)
        self.targets_at = torch.from_numpy(flat.positions(n))
        self._offsets = torch.arange(-n, 0)

    def __len__(self) -> int:
        return len(self.targets_at)

    def __getitem__(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        pos = self.targets_at[torch.as_tensor(idx)]
        return self.tokens[pos[:, None] + self._offsets].long(), self.tokens[pos].long()


class EpochBatchSampler(Sampler[Tensor]):
    """Batches of example ids, reshuffled each epoch from ``(seed, epoch)`` alone, and
    sharded by rank for multi-process runs (Lightning calls ``set_epoch``).

    Rank r takes ``ids[r::world_size]`` of the global order, so the world's batch of
    step t holds exactly the examples of a one-process batch of size
    ``world_size * batch_size``. Every rank gets the same number of batches of the same
    sizes (a distributed head's collectives need that): with ``drop_last`` the global
    order is cut to a multiple of ``world_size * batch_size``; without it the shorter
    shards are padded with id ``PAD`` (-1), which the data module turns into examples
    with target -1 that the metrics ignore."""

    PAD = -1

    def __init__(self, size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, limit: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.limit = limit
        self.epoch = 0
        self._resume_at: tuple[int, int] | None = None  # (epoch, batch) the next iteration starts at

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, batch: int) -> None:
        """The next iteration is epoch ``epoch`` from its batch ``batch`` on (a mid-epoch resume);
        the ones after it, whole epochs again. ``len`` stays the epoch's whole length."""
        if not (isinstance(epoch, int) and isinstance(batch, int) and epoch >= 0 and batch >= 0):
            raise ValueError(f"resume needs an epoch and a batch >= 0, got {epoch!r}, {batch!r}")
        self.epoch, self._resume_at = epoch, (epoch, batch)

    def next_start(self) -> int:
        """The batch the next iteration starts at (0, or where ``resume`` said)."""
        return self._resume_at[1] if self._resume_at and self._resume_at[0] == self.epoch else 0

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
        w = self.world_size
        if self.drop_last:
            ids = ids[: len(ids) - len(ids) % (w * self.batch_size)]
        elif len(ids) % w:
            ids = torch.cat([ids, ids.new_full((w - len(ids) % w,), self.PAD)])
        return ids[self.rank :: w]

    def __iter__(self) -> Iterator[Tensor]:
        start, self._resume_at = self.next_start(), None
        ids = self._ids()
        for i in range(start * self.batch_size, len(ids), self.batch_size):
            yield ids[i : i + self.batch_size]

    def __len__(self) -> int:
        return -(-len(self._ids()) // self.batch_size)
