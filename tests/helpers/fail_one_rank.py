"""One rank of a two-process gloo DDP run (launched as torchrun would: RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) in which rank 1 raises at step
3 while rank 0 waits in the gradient all-reduce; ``FailTogether`` is on. The process
group's timeout is 600 s: a rank that stops sooner did not wait for it. Rank 1 writes the
time it raised to ``<out>/failed_at``.

    python fail_one_rank.py <out dir>
"""
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lst_lightning.app.callbacks import FailTogether

MESSAGE = "non-finite loss on rank 1 at step 3"


class Tiny(pl.LightningModule):
    def __init__(self, out: Path):
        super().__init__()
        self.layer, self.out = torch.nn.Linear(4, 1), out

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 3:
            (self.out / "failed_at").write_text(repr(time.time()))
            raise FloatingPointError(MESSAGE)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    data = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=50, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[FailTogether()],
                         strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=600)))
    trainer.fit(Tiny(out), data)
