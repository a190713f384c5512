"""Checkpoints of a head whose V is sharded over ranks (``parallel="sharded"``).

Every rank builds the checkpoint (rank 0 writes it), so this runs on all of them:

- ``"whole"``: V is gathered on rank 0's host (D x d values there) and saved whole;
  the checkpoint resumes on any number of ranks, or in one process;
- ``"per_rank"``: for D too large to gather, each rank writes its rows to
  ``<checkpoint dir>/head_shards/step<N>/rank<r>.pt``; the checkpoint keeps an empty V
  and the directory in the head's extra state, from which a head of any sharding reads
  its own rows when it loads (memory-mapped). The newest ``keep`` saves are kept.

Per rank, the shard files follow the rule of the checkpoints (``AsyncAtomicCheckpointIO``):
each rank copies its rows to the host on the training thread (the state of one step; where
the copy would not fit, written at once, with a warning) and its own writer thread writes
the file (beside its name, synced, renamed), at most one in flight per rank. Rank 0's
checkpoint names the step's directory, so its writer, just before writing it, waits until
every rank's file of that step is in the directory (a shared file system: the ranks' writer
threads cannot join a barrier; ``wait_s``, then an error): a kill at any moment leaves a
``last.ckpt`` whose files are all on disk. The older step directories are pruned once that
checkpoint is. With a synchronous checkpoint IO the files are written at once, then a
barrier, then rank 0's checkpoint.
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ...heads.base import OutputHead
from ..checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO, atomic_torch_save, snapshot_too_large
from ...spherical.shard_files import check_checkpoint_settings, prune, save_shard, shard_path


def shards_beside(checkpoint: dict, path) -> None:
    """A per-rank checkpoint's head shards where the run directory now is. The checkpoint names its
    shards' directory as it was written (``<checkpoint dir>/head_shards/step<N>``); where that is
    gone (the run directory moved or copied whole, with its ``head_shards``), the directory of that
    step in the ``head_shards`` beside the checkpoint file ``path`` is named instead (or beside its
    ``checkpoints/``: Lightning's SLURM checkpoint in the run directory). Called before the state
    loads (``LanguageModel.on_load_checkpoint``); the checkpoint dict is changed in place."""
    if path is None:
        return
    here, states = Path(path).parent, checkpoint.get("state_dict", {})
    for key, extra in states.items():
        if not (key.endswith("_extra_state") and isinstance(extra, dict) and extra.get("v_files")):
            continue
        saved = Path(extra["v_files"])
        if saved.is_dir():
            continue
        for moved in (here / "head_shards" / saved.name, here / "checkpoints" / "head_shards" / saved.name):
            if moved.is_dir():
                states[key] = {**extra, "v_files": str(moved.resolve())}
                break


class ShardedHeadCheckpoint(pl.Callback):
    """``wait_s``: how long rank 0's writer waits for the other ranks' files of a save (the
    default process group's timeout, which the barrier it replaces had)."""

    def __init__(self, mode: str = "whole", keep: int = 2, wait_s: float = 1800.0):
        check_checkpoint_settings(mode, keep)
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or wait_s < 0:
            raise ValueError(f"callbacks.sharded_head_checkpoint.wait_s must be a number >= 0, got {wait_s!r}")
        self.mode, self.keep, self.wait_s = mode, keep, wait_s
        self.synchronous_saves = 0  # shards too large for a copy in free memory

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        for prefix, head in self._heads(pl_module):
            self._save(trainer, head, checkpoint["state_dict"], f"{prefix}.")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # a failed run: rank 0's writer stops waiting for the files of ranks that may never
        # write them (its save is dropped, the checkpoint before stays); SIGTERM's save goes on
        io = trainer.strategy.checkpoint_io
        if (self.mode == "per_rank" and isinstance(io, AsyncAtomicCheckpointIO)
                and not isinstance(exception, SIGTERMException) and any(self._heads(pl_module))):
            io.abandon()

    @staticmethod
    def _heads(pl_module):
        return [(prefix, head) for prefix, head in pl_module.named_modules()
                if isinstance(head, OutputHead) and head.sharded]

    def _save(self, trainer, head, state_dict: dict, prefix: str) -> None:
        if self.mode == "whole":
            V = head.gather_v()
            if V is not None:
                state_dict[prefix + "V"] = V
            return
        cb = trainer.checkpoint_callback
        root = Path(cb.dirpath if cb is not None and cb.dirpath else trainer.default_root_dir) / "head_shards"
        step, rank = trainer.global_step, trainer.global_rank
        step_dir = root / f"step{step}"
        state_dict[prefix + "V"] = head.V.new_empty(0, head.V.shape[1]).cpu()
        extra = state_dict[prefix + "_extra_state"]
        state_dict[prefix + "_extra_state"] = {**extra, "v_files": str(step_dir.resolve())}
        rows, io = (head.row_lo, head.row_hi), trainer.strategy.checkpoint_io
        if not isinstance(io, AsyncAtomicCheckpointIO):  # every file on disk before rank 0's checkpoint
            save_shard(step_dir, rank, rows, head.V, save=atomic_torch_save)
            trainer.strategy.barrier("head_shards")
            if rank == 0:
                if isinstance(io, AtomicCheckpointIO):
                    io.after_next_save(lambda: prune(root, self.keep))
                else:
                    prune(root, self.keep)
            return
        io.wait()  # this rank's file before is on disk (rank 0: its checkpoint too): one in flight
        write = self._snapshot(step_dir, rank, rows, head.V)
        if rank == 0:  # in the writer thread: this rank's file, the others', then the checkpoint
            if write is not None:
                io.before_next_save(write)
            io.before_next_save(lambda: self._await_shards(io, step_dir, trainer.world_size, step))
            io.after_next_save(lambda: prune(root, self.keep))
        elif write is not None:
            io.after_save(write)

    def _snapshot(self, step_dir: Path, rank: int, rows: tuple[int, int], V: torch.Tensor):
        """The write of this rank's file from a host copy of its rows, or None once written at
        once (no room for the copy)."""
        short = snapshot_too_large({"V": V}, to=torch.device("cpu"))
        if short:
            if not self.synchronous_saves:
                warnings.warn(f"head shard saved synchronously: {short}", RuntimeWarning, stacklevel=2)
            self.synchronous_saves += 1
            save_shard(step_dir, rank, rows, V, save=atomic_torch_save)
            return None
        copy = V.detach().to("cpu", copy=True)
        return lambda: save_shard(step_dir, rank, rows, copy, save=atomic_torch_save)

    def _await_shards(self, io: AsyncAtomicCheckpointIO, step_dir: Path, world: int, step: int) -> None:
        """Return once every rank's file of this save is in ``step_dir`` (listed, so that a
        network file system shows the directory as it is); an error after ``wait_s``."""
        names = [shard_path(step_dir, r).name for r in range(world)]
        deadline, pause = time.monotonic() + self.wait_s, 0.01
        while True:
            try:
                present = set(os.listdir(step_dir))
            except FileNotFoundError:
                present = set()
            missing = [n for n in names if n not in present]
            if not missing or io.abandoned:  # abandoned: the checkpoint is dropped after this
                return
            if time.monotonic() >= deadline:
                more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
                raise TimeoutError(f"head_checkpoint=per_rank: {', '.join(missing[:4])}{more} of {world} ranks not "
                                   f"in {step_dir} after {self.wait_s:g} s, so the checkpoint of step {step} is not "
                                   "written; per_rank needs a checkpoint directory on a file system shared by the "
                                   "ranks")
            time.sleep(pause)
            pause = min(2 * pause, 1.0)
