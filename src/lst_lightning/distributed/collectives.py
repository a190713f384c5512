"""The collectives of a run's processes (the multi-process factored head's, the app's), on
torch.distributed (gloo on CPU, NCCL on GPU). Without an initialised process group every
operation is the one-process identity, so the same code runs alone."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

_HASH_CHUNK = 1 << 22  # elements hashed at once: the weights vector stays small


@dataclass(frozen=True)
class ProcessGroup:
    """A torch.distributed group with its rank and size (world 1 when there is none)."""

    group: object | None = None
    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls, group=None) -> "ProcessGroup":
        if dist.is_available() and dist.is_initialized():
            return cls(group, dist.get_rank(group), dist.get_world_size(group))
        return cls()

    def all_reduce_(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place. Every rank receives the same bits."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_(self, x: Tensor, src: int = 0) -> Tensor:
        if self.world > 1:
            dist.broadcast(x, src=self._global(src), group=self.group)
        return x

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_gather_ints(self, values: list[int], device=None) -> Tensor:
        """(world, len(values)) int64: every rank's values."""
        x = torch.tensor(values, dtype=torch.int64, device=device)
        if self.world == 1:
            return x[None]
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x, group=self.group)
        return torch.stack(out).cpu()

    def all_gather_objects(self, obj: object) -> list:
        """Every rank's ``obj`` (picklable: an error message, random states), rank 0 first;
        never on the hot path."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_fixed(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` (the same shape on every rank) concatenated along the first
        dimension, rank 0 first: one all-gather, nothing read on the host."""
        if self.world == 1:
            return x
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        # all_gather_single where torch has it (2.13 deprecates the older name), else
        # all_gather_into_tensor (older torch, 2.11 among them): the same arguments
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out

    def gather_rows(self, tensors: list[Tensor], fills: list[float]) -> tuple[list[Tensor], slice]:
        """Concatenate every rank's rows of each tensor, rank 0 first; ranks may hold
        different numbers of rows. Returns the gathered tensors and this rank's rows."""
        out, sizes = self.gather_ragged(tensors, fills)
        lo = sum(sizes[: self.rank])
        return out, slice(lo, lo + tensors[0].shape[0])

    def gather_ragged(self, tensors: list[Tensor], fills: list[float]) -> tuple[list[Tensor], list[int]]:
        """``gather_rows``'s tensors and every rank's number of rows: the counts are
        all-gathered, each tensor padded (with its fill) to the largest and all-gathered,
        the padding cut. No rows anywhere: no tensor is sent."""
        m = tensors[0].shape[0]
        if self.world == 1:
            return tensors, [m]
        sizes = self.all_gather_ints([m], tensors[0].device)[:, 0].tolist()
        top = max(sizes)
        if top == 0:
            return tensors, sizes
        out = []
        for t, fill in zip(tensors, fills):
            padded = t.new_full((top, *t.shape[1:]), fill)
            padded[:m] = t
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded.contiguous(), group=self.group)
            out.append(torch.cat([p[:n] for p, n in zip(parts, sizes)]))
        return out, sizes


def bit_hash(tensors: list[Tensor]) -> int:
    """A position-weighted sum of the raw bits of the tensors: equal states give equal
    hashes on every rank; a change in one bit of one element changes it."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    h = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        bits = flat.view(ints[flat.element_size()]) if flat.is_floating_point() else flat
        for i, chunk in enumerate(bits.split(_HASH_CHUNK)):
            w = torch.arange(1, chunk.numel() + 1, dtype=torch.int64, device=chunk.device)
            h = h * 1_000_003 + (chunk.to(torch.int64) * (2 * w + 1)).sum() + i  # int64 wraps
    return int(h)
