"""A training DataLoader that Lightning saves and restores mid-epoch.

Lightning keeps the state of every training loader that has ``state_dict`` and
``load_state_dict`` in its checkpoints and hands it back before the resumed epoch's first
batch (its "stateful" loaders). The order of an ``EpochBatchSampler`` is a function of
``(seed, epoch)`` alone, so the state is two numbers: the epoch and how many of its batches
this loader has handed out. Loaded, the sampler skips those (without reading them) and
the run goes on with the batch the interrupted run would have trained on next.

The loader draws its workers' seeds from a generator of its own (seeded by the data seed),
not from torch's global one, whose state a resumed run restores: a plain DataLoader draws
from it at every new iterator, which a resumed run makes at another point of the stream."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from .ngram import EpochBatchSampler


class ResumableLoader(DataLoader):
    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, generator=torch.Generator().manual_seed(seed), **kwargs)
        if not isinstance(self.sampler, EpochBatchSampler):
            raise TypeError(f"ResumableLoader needs an EpochBatchSampler, got {type(self.sampler).__name__}")
        self._position = (0, 0)  # (epoch, batches handed out in it)

    def __iter__(self) -> Iterator:
        # A generator: nothing is read before the first batch is asked for, so a position
        # loaded after ``iter()`` (Lightning makes the iterator first) still counts.
        epoch, served = self.sampler.epoch, self.sampler.next_start()
        self._position = (epoch, served)
        for batch in super().__iter__():
            served += 1
            self._position = (epoch, served)
            yield batch

    def state_dict(self) -> dict:
        """The epoch of the last batch handed out, and how many of its batches were."""
        epoch, batches = self._position
        return {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.resume(int(state["epoch"]), int(state["batches"]))
        self._position = (int(state["epoch"]), int(state["batches"]))
