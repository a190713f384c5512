"""A callback that stops the background write of one checkpoint halfway, so that a test can
kill the run (SIGKILL) in the middle of an asynchronous save.

Added to lst-train as ``+callbacks.hold_save._target_=hold_save.HoldSave`` (tests/helpers on
PYTHONPATH); it acts only when ``LST_HOLD_SAVE_AT=<step>`` (the checkpoint of that step) or
``LST_HOLD_SHARD_AT=<step>`` (the last rank's head shard file of that step,
head_checkpoint=per_rank) is set. That file is serialised in full, half of its bytes are
written to the file being written, and the writer thread then waits forever, after writing
``<run_dir>/saving``. Training goes on meanwhile; ``<run_dir>/trained`` holds the number of
the last step finished."""
import io
import os
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch


class HoldSave(pl.Callback):
    def __init__(self):
        at, shard_at = os.environ.get("LST_HOLD_SAVE_AT"), os.environ.get("LST_HOLD_SHARD_AT")
        self.at = int(at) if at else None
        self.shard_at = int(shard_at) if shard_at else None

    def setup(self, trainer, pl_module, stage):
        if self.at is None and self.shard_at is None:
            return
        save, root = torch.save, Path(trainer.default_root_dir)
        last_rank = trainer.global_rank == trainer.world_size - 1

        def held(obj, f) -> bool:
            if threading.current_thread() is threading.main_thread() or not isinstance(obj, dict):
                return False
            if "rows" in obj:  # a head shard file, written to a temporary name in its step's directory
                return last_rank and Path(getattr(f, "name", "")).parent.name == f"step{self.shard_at}"
            return obj.get("global_step") == self.at

        def half_then_hold(obj, f, *args, **kwargs):
            if not held(obj, f):
                return save(obj, f, *args, **kwargs)
            whole = io.BytesIO()
            save(obj, whole, *args, **kwargs)
            f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            f.flush()
            (root / "saving").write_text(str(self.at if self.shard_at is None else self.shard_at))
            while True:
                time.sleep(0.05)
        torch.save = half_then_hold

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at is not None or self.shard_at is not None:
            Path(trainer.default_root_dir, "trained").write_text(str(trainer.global_step))
