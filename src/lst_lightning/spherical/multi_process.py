"""The process-group work of the factored head (``parallel``; docs/multi_gpu.md), one object the
head holds (``head.processes``), which the step calls only when it is not ``alone``: one process
(``Processes``), every rank holding the whole head (``Replicated``: every rank applies the same
global update, bit for bit, checked by a hash every ``checksum_every`` steps) or V's rows sharded
(``ShardedRows``). A training step gathers every rank's rows: under device flags padded to a
capacity agreed at the first step, with no host read (``processes.padded``, padded_rows.py); with
``sync_every=1`` the row counts gathered and read, the padding cut. Each rank gets ``world x
dL/dH`` for its own rows, so that DDP's averaging of the body's gradients gives the gradient of the
global-batch loss. A multi-process head starts unjoined; ``head.distribute()`` (every rank, or the
first forward) swaps in the object of its process group.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..distributed.collectives import ProcessGroup
from .exact_step import UNEXCHANGED
from .padded_rows import PaddedRows
from .state import REPLICATED_STATE


class Processes:
    """One process: the whole V here, every collective the identity."""

    parallel = "none"
    sharded = False

    def __init__(self, num_classes: int, pg: ProcessGroup | None = None, rows: tuple[int, int] | None = None,
                 joined: bool = True):
        self.num_classes = num_classes
        self.pg = pg if pg is not None else ProcessGroup()
        #: V holds the rows of classes [lo, hi): all of them unless sharded.
        self.lo, self.hi = rows if rows is not None else (0, num_classes)
        #: whether distribute() has run (one process: nothing to run)
        self.joined = joined
        #: one process, joined, unsharded: every operation here is the identity, and the
        #: step (exact_step.py, driver.py, base.py) does not call into this object at all
        self.alone = joined and self.pg.world == 1 and not self.sharded
        #: the training steps' rows under device flags, padded to the capacity agreed at the first
        self.padded = PaddedRows(self.pg)
        #: the real rows of the batch the step works on, a device count, where it was padded
        #: (None: the batch's own rows); the "mean" reduction divides by it
        self.rows: Tensor | None = None
        #: the exchange the batch's rows came through (``padded`` where they were padded), for the step's screen
        self.exchange = UNEXCHANGED

    @property
    def world(self) -> int:
        return self.pg.world

    def joined_to(self, pg: ProcessGroup) -> "Processes":
        """This head's processes over ``pg``."""
        return type(self)(self.num_classes, pg, self.shard_rows(pg.rank, pg.world), joined=True)

    def shard_rows(self, rank: int, world: int) -> tuple[int, int]:
        """The classes [lo, hi) whose rows of V rank ``rank`` of ``world`` holds."""
        return 0, self.num_classes

    # -- the step ---------------------------------------------------------------------------
    def agree(self, head, prepare, step: bool):
        """``prepare()``, agreed on by every rank that shares the step: one rank's bad input
        raises on all of them, with that rank's message, before any of them changes. A
        training step under device flags: at the first, this read also agrees on the capacity
        of the padded rows (padded_rows.py); at the later ones nothing is read, and a rank's
        bad input voids the step on every rank, raised at the next read of the flags."""
        if not (self.world > 1 and (self.sharded or step)):
            return prepare()
        padded = step and head.plan.deferred
        if padded and self.padded.capacity is not None:
            return self.padded.prepare(head, prepare)
        try:
            out, err = prepare(), None
        except (ValueError, TypeError) as e:
            out, err = None, e
        sizes = [0, 0] if out is None or out[1] is None else [out[0].shape[0], out[1].shape[1]]
        said = self.pg.all_gather_ints([int(err is not None), *sizes], head.device).tolist()
        if any(failed for failed, *_ in said):  # all ranks raise, none has changed
            said = self.pg.all_gather_objects(None if err is None else f"{type(err).__name__}: {err}")
            if err is not None:
                raise err
            first = next(r for r, text in enumerate(said) if text is not None)
            raise ValueError(f"rank {first}'s input to the head was invalid ({said[first]}); no rank changed state")
        if padded:
            self.padded.agree(head, [sent for _, *sent in said])
        return out

    def collect(self, Hx: Tensor, idx: Tensor, T: Tensor, training: bool):
        """The batch the step works on (all ranks' rows) and this rank's rows in it (None: all)."""
        self.rows, self.exchange = None, UNEXCHANGED
        if self.world == 1 or not (training or self.sharded):
            return Hx, idx, T, None
        if training and self.padded.code is not None:  # prepared under device flags: no host read
            self.rows, self.exchange = self.padded.rows, self.padded
            return self.padded.gather(Hx, idx, T)
        (Hx, idx, T), rows = self.pg.gather_rows([Hx, idx, T], [0.0, -1, 0.0])
        return Hx, idx, T, rows

    def own_rows(self, dH: Tensor, rows: slice | None) -> Tensor:
        return dH if rows is None else dH[rows] * self.world

    def local_idx(self, idx: Tensor) -> Tensor:
        """Class ids as rows of the V held here (-1: another rank's)."""
        return idx

    def all_reduce_(self, x: Tensor) -> Tensor:
        """The sum over the ranks that hold parts of V (one process, replicated: x itself)."""
        return x

    # -- the replicas -------------------------------------------------------------------------
    def hashed_state(self) -> tuple[str, ...]:
        """The buffers every rank must hold alike (V too unless sharded)."""
        return REPLICATED_STATE + ("V",)

    def check_replicas(self, head) -> None:
        if self.world == 1:
            return
        h = self.pg.all_gather_ints([head.state_hash()], head.device)[:, 0]
        if not bool((h == h[0]).all()):
            raise RuntimeError(f"{type(head).__name__}: the replicas diverged by step {int(head.steps)} "
                               f"(state hashes per rank: {h.tolist()}). Same inputs and deterministic "
                               "kernels keep them equal: did a rank get another lr or another batch?")

    def gather_v(self, V: Tensor, dst: int = 0) -> Tensor | None:
        """All of V on rank ``dst`` (on the host), None on the other ranks."""
        return V.cpu()


class Replicated(Processes):
    """Every rank holds the whole head and applies the global step."""

    parallel = "replicated"


class ShardedRows(Processes):
    """Rank r holds V's rows [lo, hi); the rest of the state is replicated. The step's gathers and
    scatter of V's rows are this object's (the plan's, each bound to the plan's ``kernels``, the
    kernel ops it calls on the rows held here; with V whole, those ops themselves)."""

    parallel = "sharded"
    sharded = True

    def shard_rows(self, rank: int, world: int) -> tuple[int, int]:
        per = -(-self.num_classes // world)
        return min(rank * per, self.num_classes), min((rank + 1) * per, self.num_classes)

    def local_idx(self, idx: Tensor) -> Tensor:
        inside = (idx >= self.lo) & (idx < self.hi)
        return torch.where(inside, idx - self.lo, -1)

    def gather_dot(self, kernels, V: Tensor, idx: Tensor, X: Tensor, x0: Tensor) -> Tensor:
        A = self.pg.all_reduce_(kernels.gather_dot(V, self.local_idx(idx), X))  # one owner per slot
        return torch.where(idx >= 0, A + x0[:, None], 0.0)

    def gather_sum(self, kernels, V: Tensor, idx: Tensor, G: Tensor) -> Tensor:
        return self.pg.all_reduce_(kernels.gather_sum(V, self.local_idx(idx), G))

    def scatter_rows(self, kernels, V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha, order=None) -> Tensor:
        """``kernels.scatter_add_rows_`` into the rows of V held here (the ids' sort, of every rank's
        rows, is not reused)."""
        return kernels.scatter_add_rows_(V, self.local_idx(idx), G, X, alpha)

    def rows_of(self, V: Tensor, ids: Tensor) -> Tensor:
        """V's rows of the classes ``ids`` (u, d), wherever they are held."""
        local = self.local_idx(ids)  # each row has one owner: the others contribute zeros (u x d values)
        rows = V[local.clamp(min=0)] if V.shape[0] else V.new_zeros(ids.numel(), V.shape[1])
        return self.pg.all_reduce_(torch.where(local[:, None] >= 0, rows, 0.0))

    def all_reduce_(self, x: Tensor) -> Tensor:
        return self.pg.all_reduce_(x)

    def hashed_state(self) -> tuple[str, ...]:
        return REPLICATED_STATE

    def gather_v(self, V: Tensor, dst: int = 0) -> Tensor | None:
        if self.world == 1:
            return V.cpu()
        pg = self.pg
        out = torch.empty(self.num_classes, V.shape[1], dtype=V.dtype) if pg.rank == dst else None
        for r in range(pg.world):  # one shard at a time: rank dst holds V once, not twice
            lo, hi = self.shard_rows(r, pg.world)
            buf = V if r == pg.rank else V.new_empty(hi - lo, V.shape[1])
            pg.broadcast_(buf, src=r)
            if out is not None:
                out[lo:hi] = buf.cpu()
        return out


def processes_for(parallel: str, num_classes: int) -> Processes:
    """The processes a head starts with: one process is joined already; a multi-process
    head waits for ``distribute()`` (a sharded one holds no rows until then)."""
    if parallel == "none":
        return Processes(num_classes)
    if parallel == "replicated":
        return Replicated(num_classes, joined=False)
    return ShardedRows(num_classes, rows=(0, 0), joined=False)
