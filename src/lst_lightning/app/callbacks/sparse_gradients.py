"""Row-sparse gradients (a sparse input embedding's, a ``head.sparse`` head's rows) kept
out of DDP and averaged over the ranks by all-gathers at the optimizer's step, on gloo
and NCCL alike (app/sparse_exchange.py). Works with any LightningModule that lists
these parameters in ``_ddp_params_and_buffers_to_ignore`` (the app's ``LanguageModel``
does, and adds this callback itself)."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ...heads.flag_board import FlagBoard
from ...spherical.driving import SYNC_EVERY
from ..optimizers import sparse_embedding_params
from ..sparse_exchange import average_sparse_gradients

BYTES_KEY = "train/sparse_exchange_bytes"  # logged: what each rank received for these gradients per step


class SparseGradients(pl.Callback):
    """At fit start, rank 0's values of the row-sparse parameters go to every rank (what
    DDP does for the parameters it wraps); at every optimizer step, after all the
    micro-batches' backward passes and before clipping, their gradients are averaged over
    the ranks. Static rows' exchanges keep their faults on ``board``: the module's
    (``LanguageModel.flag_board``), read by its owner; else one of this callback's own, read
    every ``check_every`` steps and at the end of training (one host transfer each). One
    process: nothing."""

    def __init__(self, board: FlagBoard | None = None, check_every: int = SYNC_EVERY):
        self.bytes_last_step = 0
        #: whether this callback reads ``board`` itself (no board given)
        self.reads = board is None
        self.board = FlagBoard() if board is None else board
        self.check_every = check_every

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
        params = sparse_embedding_params(pl_module)
        self.bytes_last_step = average_sparse_gradients(params, step=trainer.global_step, board=self.board)
        pl_module.log(BYTES_KEY, float(self.bytes_last_step))
        if self.reads and (trainer.global_step + 1) % self.check_every == 0:
            self.board.read()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active(trainer) and self.reads:
            self.board.read()
