"""Multi-process training of the factored head (``parallel``; docs/multi_gpu.md).

- ``"replicated"``: every rank holds the whole head; each training step all-gathers
  H and the targets, so every rank applies the same global update, bit for bit
  (checked by a hash of the state every ``checksum_every`` steps);
- ``"sharded"``: rank r holds V's rows for classes ``[row_lo, row_hi)``; U, U^-1,
  omega, Q and wbar are replicated. The gather-dot and gather-sum are all-reduced
  (m K and m d values) and each rank scatters into its own rows only.

Either way each rank gets ``world x dL/dH`` for its own rows, so that DDP's averaging
of the body's gradients gives the gradient of the global-batch loss. Call
``distribute()`` on every rank once torch.distributed is up (or let the first
forward do it); without a process group every operation is the one-process identity.
"""
from __future__ import annotations

import torch
from torch import Tensor

import lst_kernels as lk

from .collectives import ProcessGroup, bit_hash
from .shard_files import load_rows
from .state import REPLICATED_STATE
from .step_mode import PARALLEL_MODES  # noqa: F401  (re-exported: its old home)


class MultiProcess:
    """Process-group state and collectives, as methods of ``FactoredSphericalHead``."""

    parallel_modes = ("replicated", "sharded")

    def _init_multi_process(self, checksum_every: int) -> None:
        if not (isinstance(checksum_every, int) and checksum_every >= 0):
            raise ValueError(f"checksum_every must be an int >= 0, got {checksum_every!r}")
        self.checksum_every = checksum_every
        self._pg = ProcessGroup()
        self._distributed = self.parallel == "none"

    @property
    def sharded(self) -> bool:
        return self.parallel == "sharded"

    @torch.no_grad()
    def distribute(self, process_group=None) -> None:
        """Join the ranks of ``process_group`` (default: the whole world; alone when
        torch.distributed is not initialised). Every rank must call it: rank 0's state
        is taken by all (its V rows, for a shard); a sharded head makes its own rows."""
        if self.parallel == "none":
            return
        pg = ProcessGroup.current(process_group)
        if self._distributed and (pg.rank, pg.world) == (self._pg.rank, self._pg.world):
            return
        if self._distributed and self.sharded and self._pg.world > 1:
            raise RuntimeError("a sharded head cannot be re-distributed over another group")
        dev, D = self.device, self.num_classes
        for name in REPLICATED_STATE:
            pg.broadcast_(getattr(self, name))
        self._init_seed = int(pg.all_gather_ints([self._init_seed], dev)[0, 0])
        same_v = False
        if self.V.shape[0] == D:
            h = bit_hash([self.V])
            same_v = bool((pg.all_gather_ints([h], dev) == h).all())
        if self.parallel == "replicated":
            if not same_v:
                pg.broadcast_(self.V)
        else:
            lo, hi = self._shard_rows(pg.rank, pg.world)
            if same_v:
                self.V = self.V[lo:hi].clone()
            elif self.V.shape[0] == 0 and not int(self.steps):
                self.V = self._init_rows(lo, hi, dev)
            else:
                raise RuntimeError("the ranks hold different V: distribute() a sharded head before training it")
            self.row_lo, self.row_hi = lo, hi
        self._pg, self._distributed = pg, True
        self.refresh_bookkeeping()  # also bumps the version: no stale backward survives this

    def _shard_rows(self, rank: int, world: int) -> tuple[int, int]:
        """The classes [lo, hi) whose rows of V rank ``rank`` of ``world`` holds when sharded."""
        per = -(-self.num_classes // world)
        return min(rank * per, self.num_classes), min((rank + 1) * per, self.num_classes)

    def _ensure_distributed(self) -> None:
        if not self._distributed:
            self.distribute()

    def _prepare_everywhere(self, H, target_idx, target_val, step: bool | None = None):
        self._ensure_distributed()
        step = self.in_training_step if step is None else step
        if not (self._pg.world > 1 and (self.sharded or step)):
            return self.prepare(H, target_idx, target_val, step=step)
        try:
            out, err = self.prepare(H, target_idx, target_val, step=step), None
        except (ValueError, TypeError) as e:
            out, err = None, e
        if self._pg.any(err is not None, self.device):  # all ranks raise, none has changed
            raise err if err is not None else ValueError(
                "another rank's input to the head was invalid (its error says why); no rank changed state")
        return out

    def _collect(self, Hx, idx, T, training):
        if self._pg.world == 1 or not (training or self.sharded):
            return Hx, idx, T, None
        (Hx, idx, T), rows = self._pg.gather_rows([Hx, idx, T], [0.0, -1, 0.0])
        return Hx, idx, T, rows

    def _own_rows(self, dH, rows):
        return dH if rows is None else dH[rows] * self._pg.world

    def _local_idx(self, idx: Tensor) -> Tensor:
        if not self.sharded:
            return idx
        inside = (idx >= self.row_lo) & (idx < self.row_hi)
        return torch.where(inside, idx - self.row_lo, -1)

    def _gather_dot(self, idx: Tensor, X: Tensor, x0: Tensor) -> Tensor:
        if not self.sharded:
            return lk.gather_dot(self.V, idx, X, x0)
        A = self._pg.all_reduce_(lk.gather_dot(self.V, self._local_idx(idx), X))  # one owner per slot
        return torch.where(idx >= 0, A + x0[:, None], 0.0)

    def _gather_sum(self, idx: Tensor, G: Tensor) -> Tensor:
        if not self.sharded:
            return lk.gather_sum(self.V, idx, G)
        return self._pg.all_reduce_(lk.gather_sum(self.V, self._local_idx(idx), G))

    @torch.no_grad()
    def gather_v(self, dst: int = 0) -> Tensor | None:
        """All of V on rank ``dst`` (on the host), None on the other ranks; every rank must
        call it. A checkpoint holding it loads into a head sharded over any number of ranks."""
        if not self.sharded or self._pg.world == 1:
            return self.V.cpu()
        out = torch.empty(self.num_classes, self.width, dtype=self.dtype) if self._pg.rank == dst else None
        for r in range(self._pg.world):  # one shard at a time: rank dst holds V once, not twice
            lo, hi = self._shard_rows(r, self._pg.world)
            buf = self.V if r == self._pg.rank else self.V.new_empty(hi - lo, self.width)
            self._pg.broadcast_(buf, src=r)
            if out is not None:
                out[lo:hi] = buf.cpu()
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        V = state_dict.get(prefix + "V")
        files = (state_dict.get(prefix + "_extra_state") or {}).get("v_files")
        if V is not None and (files is not None or (self.sharded and V.shape[0] == self.num_classes != self.V.shape[0])):
            self._ensure_distributed()
            # A whole V (from gather_v), or one file per rank (shard_files): keep this rank's rows.
            mine = load_rows(files, self.row_lo, self.row_hi) if files is not None else V[self.row_lo:self.row_hi]
            state_dict = {**state_dict, prefix + "V": mine}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def state_hash(self) -> int:
        """A hash of the bits of the state every rank must hold alike (V too unless sharded)."""
        names = REPLICATED_STATE + (() if self.sharded else ("V",))
        return bit_hash([getattr(self, n) for n in names])

    def check_replicas(self) -> None:
        """Raise on every rank when the ranks' shared state differs in any bit."""
        if self._pg.world == 1:
            return
        h = self._pg.all_gather_ints([self.state_hash()], self.device)[:, 0]
        if not bool((h == h[0]).all()):
            raise RuntimeError(f"{type(self).__name__}: the replicas diverged by step {int(self.steps)} "
                               f"(state hashes per rank: {h.tolist()}). Same inputs and deterministic "
                               "kernels keep them equal: did a rank get another lr or another batch?")
