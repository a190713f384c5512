"""A callback that holds a run still at the start of one training step, so that a test can
kill it (SIGKILL) or preempt it (SIGTERM) at a known step from outside.

Added to lst-train as ``+callbacks.stall._target_=stall.Stall`` (tests/helpers on
PYTHONPATH); it acts only when ``LST_STALL_AT=<step>`` is set, so a resumed run with the
same command goes through. At the start of that step it writes ``<run_dir>/stalled`` (the
steps before it are done and their checkpoints on disk) and waits until the process receives SIGTERM (then the
step runs, and Lightning stops the run at its end) or is killed."""
import os
import time
from pathlib import Path

import lightning.pytorch as pl


class Stall(pl.Callback):
    def __init__(self):
        at = os.environ.get("LST_STALL_AT")
        self.at = int(at) if at else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at is None or trainer.global_step != self.at:
            return
        wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
        if wait is not None:  # the saves before this step are on disk (written in the background)
            wait()
        Path(trainer.default_root_dir, "stalled").write_text(str(trainer.global_step))
        while not trainer.received_sigterm:
            time.sleep(0.05)
