"""A callback that stops the background write of one checkpoint halfway, so that a test can
kill the run (SIGKILL) in the middle of an asynchronous save.

Added to lst-train as ``+callbacks.hold_save._target_=hold_save.HoldSave`` (tests/helpers on
PYTHONPATH); it acts only when ``LST_HOLD_SAVE_AT=<step>`` is set. The checkpoint of that
step is serialised in full, half of its bytes are written to the file being written, and the
writer thread then waits forever, after writing ``<run_dir>/saving``. Training goes on
meanwhile; ``<run_dir>/trained`` holds the number of the last step finished."""
import io
import os
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch


class HoldSave(pl.Callback):
    def __init__(self):
        at = os.environ.get("LST_HOLD_SAVE_AT")
        self.at = int(at) if at else None

    def setup(self, trainer, pl_module, stage):
        if self.at is None:
            return
        save, at, root = torch.save, self.at, Path(trainer.default_root_dir)

        def half_then_hold(obj, f, *args, **kwargs):
            if threading.current_thread() is threading.main_thread() or obj.get("global_step") != at:
                return save(obj, f, *args, **kwargs)
            whole = io.BytesIO()
            save(obj, whole, *args, **kwargs)
            f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            f.flush()
            (root / "saving").write_text(str(at))
            while True:
                time.sleep(0.05)
        torch.save = half_then_hold

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at is not None:
            Path(trainer.default_root_dir, "trained").write_text(str(trainer.global_step))
