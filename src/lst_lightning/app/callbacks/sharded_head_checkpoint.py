"""Checkpoints of a head whose V is sharded over ranks (``parallel="sharded"``).

Every rank builds the checkpoint (rank 0 writes it), so this runs on all of them:

- ``"whole"``: V is gathered on rank 0's host (D x d values there) and saved whole;
  the checkpoint resumes on any number of ranks, or in one process;
- ``"per_rank"``: for D too large to gather, each rank writes its rows to
  ``<checkpoint dir>/head_shards/step<N>/rank<r>.pt``; the checkpoint keeps an empty V
  and the directory in the head's extra state, from which a head of any sharding reads
  its own rows when it loads (memory-mapped). The newest ``keep`` saves are kept.

The shard files are written at once, on every rank, before the checkpoint that names them
is saved (each renamed into place when complete): when that checkpoint is written in the
background (``AsyncAtomicCheckpointIO``), every rank's rows are already on disk, which a
writer thread could not ensure (it cannot join the ranks' barrier). The older step
directories are pruned once that checkpoint is on disk.
"""
from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl

from ...heads.base import OutputHead
from ..checkpoint_io import AsyncAtomicCheckpointIO
from ...spherical.shard_files import prune, save_shard

MODES = ("whole", "per_rank")


class ShardedHeadCheckpoint(pl.Callback):
    def __init__(self, mode: str = "whole", keep: int = 2):
        if mode not in MODES:
            raise ValueError(f"head_checkpoint must be 'whole' or 'per_rank', not {mode!r}")
        if not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"head_shards_keep must be an int >= 1, got {keep!r}")
        self.mode, self.keep = mode, keep

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        for prefix, head in pl_module.named_modules():
            if isinstance(head, OutputHead) and head.sharded:
                self._save(trainer, head, checkpoint["state_dict"], f"{prefix}.")

    def _save(self, trainer, head, state_dict: dict, prefix: str) -> None:
        if self.mode == "whole":
            V = head.gather_v()
            if V is not None:
                state_dict[prefix + "V"] = V
            return
        cb = trainer.checkpoint_callback
        root = Path(cb.dirpath if cb is not None and cb.dirpath else trainer.default_root_dir) / "head_shards"
        step_dir = root / f"step{trainer.global_step}"
        save_shard(step_dir, trainer.global_rank, (head.row_lo, head.row_hi), head.V)
        state_dict[prefix + "V"] = head.V.new_empty(0, head.V.shape[1]).cpu()
        state_dict[prefix + "_extra_state"] = {**state_dict[prefix + "_extra_state"], "v_files": str(step_dir.resolve())}
        trainer.strategy.barrier("head_shards")  # every shard written before any is pruned
        if trainer.global_rank == 0:
            io = trainer.strategy.checkpoint_io
            if isinstance(io, AsyncAtomicCheckpointIO):  # the checkpoint naming these files is not on disk yet
                io.after_next_save(lambda: prune(root, self.keep))
            else:
                prune(root, self.keep)
