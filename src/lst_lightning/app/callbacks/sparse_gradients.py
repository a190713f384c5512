"""Row-sparse gradients (a sparse input embedding's, a ``head.sparse`` head's rows) kept
out of DDP and averaged over the ranks by all-gathers at the optimizer's step, on gloo
and NCCL alike (app/sparse_exchange.py). Works with any LightningModule that lists
these parameters in ``_ddp_params_and_buffers_to_ignore`` (the app's ``LanguageModel``
does, and adds this callback itself)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ..optimizers import sparse_embedding_params
from ..sparse_exchange import average_sparse_gradients

BYTES_KEY = "train/sparse_exchange_bytes"  # logged: what each rank received for these gradients per step


class SparseGradients(pl.Callback):
    """At fit start, rank 0's values of the row-sparse parameters go to every rank (what
    DDP does for the parameters it wraps); at every optimizer step, after all the
    micro-batches' backward passes and before clipping, their gradients are averaged over
    the ranks. One process: nothing."""

    def __init__(self):
        self.bytes_last_step = 0

    @staticmethod
    def _active(trainer: pl.Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_available() and dist.is_initialized()

    @torch.no_grad()
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active(trainer):
            for p in sparse_embedding_params(pl_module):
                dist.broadcast(p.data, src=0)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if not self._active(trainer):
            return
        self.bytes_last_step = average_sparse_gradients(sparse_embedding_params(pl_module))
        pl_module.log(BYTES_KEY, float(self.bytes_last_step))
