"""One LightningModule for any body and any output head.

Ordinary heads are trained by the optimizer with the body (their own lr:
``optimizer.head_lr``). Self-updating heads (the factored and naive spherical heads)
apply their exact SGD step inside ``loss.backward()``; their learning rate (the one they
were built with, ``head.lr``) follows the body's schedule:
``head.lr = head_base_lr * current_lr / optimizer.lr``, set before every step and logged.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..heads.base import OutputHead
from ..heads.flag_board import FlagBoard
from ..spherical.driving import SYNC_EVERY
from .callbacks.head_steps import HeadSteps
from .callbacks.sharded_head_checkpoint import shards_beside
from .callbacks.sparse_gradients import SparseGradients
from .callbacks.time_budget import budget_timer, training_clock
from .fsdp_body import shard_body, whole
from .metrics import TOPK, Perplexity, RankMetrics, WeightedMean, simlex_spearman
from .compiling import Compiled, install
from .loss_checks import LossChecks
from .optimizers import (check_optimizer_config, clip_gradients, has_gradient, make_optimizer, sparse_embedding_params,
                         static_rows_for)
from .run_keys import LOSS, PERPLEXITY, SIMLEX
from .schedule import lr_factor


def check_distributed(head: OutputHead, world_size: int) -> None:
    """A self-updating head applies its own SGD step: DDP cannot average it, so with
    several processes the head must run its own collectives (``parallel``)."""
    if world_size <= 1 or not head.self_updating:
        return
    name = type(head).__name__
    if not head.parallel_modes:
        raise ValueError(f"{name} updates itself in backward and has no multi-process mode: "
                         f"it cannot train with {world_size} processes; use trainer=cpu or gpu (one process)")
    if head.parallel == "none":
        raise ValueError(f"{name} with parallel=none would train a different head on each of the "
                         f"{world_size} processes: set head.parallel to one of {list(head.parallel_modes)}")


def time_spent(timer) -> float:
    """The share of ``trainer.max_time`` spent (its ``TrainingClock``, a ``Timer``; it restores the elapsed
    time on resume), 0 without a time budget."""
    if timer is None or timer.time_remaining() is None:
        return 0.0
    elapsed = timer.time_elapsed()
    return elapsed / max(elapsed + timer.time_remaining(), 1e-9)


def as_rows(hidden: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """A sequence body's (b, T, d) hidden states and (b, T) targets as the head's rows
    (b*T, d) and (b*T,); an n-gram body's (m, d) and (m,) or (m, K) pass through."""
    if hidden.dim() == 3:
        if target.shape != hidden.shape[:2]:
            raise ValueError(f"a sequence body's hidden states {tuple(hidden.shape)} need targets of shape "
                             f"{tuple(hidden.shape[:2])}, got {tuple(target.shape)}")
        return hidden.flatten(0, 1), target.reshape(-1)
    return hidden, target


class LanguageModel(pl.LightningModule):
    def __init__(self, body: nn.Module, head: OutputHead, *, optimizer: dict | None = None,
                 scheduler: dict | None = None, topk: Sequence[int] = TOPK,
                 perplexity: bool = False, score_chunk_size: int = 65536, simlex: dict | None = None,
                 check_every: int = SYNC_EVERY):
        super().__init__()
        if not isinstance(head, OutputHead):
            raise TypeError(f"head must be an OutputHead, got {type(head).__name__}")
        if perplexity and not head.has_log_prob:
            raise ValueError(f"{type(head).__name__} (with this loss) defines no probabilities: "
                             "it cannot give perplexity; set metrics.perplexity=false or auto")
        self.body, self.head = body, head
        self.optim_cfg = {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "embedding": "row_adam",
                          "embedding_lr": None, "head_rows": None, "head_lr": None, **(optimizer or {})}
        # the body's sparse embedding, the head's sparse rows, every lr (optimizers.py)
        check_optimizer_config(self.optim_cfg)
        static_rows_for(body, head, self.optim_cfg)  # the tables row_adam steps, in static shapes
        check_optimizer_config(self.optim_cfg, self)
        if head.self_updating and self.optim_cfg["head_lr"] is not None:
            raise ValueError(f"optimizer.head_lr={self.optim_cfg['head_lr']} is the lr of an ordinary head's optimizer "
                             f"groups: {type(head).__name__} is not in the optimizer, its own SGD lr is head.lr "
                             f"(write head.lr={self.optim_cfg['head_lr']})")
        self.sched_cfg = {"name": "constant", "warmup_steps": 0, "min_factor": 0.0, **(scheduler or {})}
        lr_factor(0, total_steps=1, **self.sched_cfg)  # rejects a bad name now
        #: a self-updating head's own SGD lr at the schedule's factor 1: the one it was built with
        self.head_base_lr = float(head.lr) if head.self_updating else None
        self.perplexity, self.score_chunk_size = perplexity, score_chunk_size
        # simlex: {"pairs": [(a, b, score)], "index": {word: id}, "skip": [ids]}
        self.simlex = simlex
        self.val_ranks, self.test_ranks = RankMetrics(topk), RankMetrics(topk)
        self.val_ppl, self.test_ppl = Perplexity(), Perplexity()
        self.val_loss, self.test_loss = WeightedMean(), WeightedMean()
        #: what ``compile`` compiles (compiling.py; set by the app before training, installed at fit start)
        self.compiled = Compiled()
        #: the app's device flags where the head has no deferred checks (an ordinary head's loss, a
        #: sparse embedding's exchange), read every ``check_every`` steps (``flag_board``)
        self.loss_checks = LossChecks(check_every)
        self._head_distributed = False
        self._body_sharded = False  # configure_model: FSDP2 units made once
        self._fit_start = time.perf_counter()  # reset in on_train_start

    @property
    def flag_board(self) -> FlagBoard:
        """The board the app's device flags ride on (heads/flag_board.py): the head's where it has
        deferred checks (read with its flags, every ``sync_every`` steps), else the app's own
        (``loss_checks``, every ``check_every`` steps)."""
        return self.head.flag_board if self.head.deferred_checks else self.loss_checks.board

    # -- multi-process ----------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Once torch.distributed is up (every rank): the head joins the process group,
        and DDP is told to leave alone the buffers the head keeps consistent itself
        (``head.buffers_kept_alike()``). By default DDP would copy rank 0's buffers over
        every rank (at wrap time, every forward, and before validate/test): for the head's
        V (D x d) that is huge, and wrong when V is sharded. Ignoring
        them here, rather than ``broadcast_buffers=False`` in the strategy, covers
        every strategy config and the validate/test sync too, and still broadcasts the
        body's buffers."""
        world = self._trainer.world_size if self._trainer is not None else 1
        check_distributed(self.head, world)
        if not self._head_distributed:
            self.head.distribute()  # the default group: Lightning's
            self._head_distributed = True  # setup runs again for validate/test in the same processes
        # the buffers the head keeps consistent itself (its replicas, its shards, moments of every rank's rows)
        ignore = [f"head.{n}" for n in self.head.buffers_kept_alike()]
        # row-sparse gradients: averaged by all-gathers on any backend (callbacks.SparseGradients)
        sparse = {id(p) for p in sparse_embedding_params(self)}
        ignore += [n for n, p in self.named_parameters() if id(p) in sparse]
        if ignore:
            self._ddp_params_and_buffers_to_ignore = ignore

    def configure_model(self) -> None:
        """Under ``trainer.strategy=fsdp2`` (Lightning's ModelParallelStrategy, once the processes
        and the device mesh are up): the body sharded by FSDP2, the head out of it (fsdp_body.py).
        Once: Lightning calls this again for validate and test."""
        from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: PLC0415

        if self._trainer is None or self._body_sharded or not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        shard_body(self, self.trainer.strategy.device_mesh["data_parallel"])
        self._body_sharded = True

    # -- optimisation ---------------------------------------------------------------
    def configure_optimizers(self):
        # row-sparse parameters (sparse embeddings, head.sparse rows) go to a row-sparse
        # optimiser (optimizer.embedding); optimizer.head_lr gives an ordinary head groups of its own
        world = self.trainer.world_size if self._trainer is not None else 1
        # RowAdam's update compiled with the model, on one process (several exchange rows of any number)
        rows = (self.compiled.mode or "") if self.compiled.any and world == 1 else None
        opt = make_optimizer(self, self.optim_cfg, head=self.head, compiled_rows=rows)
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1  # inf: no step limit
        # the time budget: the training clock of trainer.max_time, or a Timer of the caller's
        timer = budget_timer(self.trainer) if self._trainer else None
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, total_steps=total, time_spent=time_spent(timer), **self.sched_cfg))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # torch's clip_grad_norm_ refuses row-sparse gradients: clip them with the dense ones
        params = [p for g in optimizer.param_groups for p in g["params"]]
        sparse = {id(p) for p in sparse_embedding_params(self)}
        if gradient_clip_val and any(id(p) in sparse and has_gradient(p) for p in params):
            clip_gradients(params, float(gradient_clip_val), gradient_clip_algorithm or "norm")
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_callbacks(self):
        # A self-updating head steps at the optimizer's step under accumulation or a loss scaler.
        # Lightning asks again at test/validate: a second one would only be announced as a replacement.
        # Row-sparse gradients (kept out of DDP in setup) are averaged over the ranks by SparseGradients.
        have = {type(c) for c in self.trainer.callbacks} if self._trainer is not None else set()
        made = [HeadSteps()] if self.head.self_updating else []
        made += [SparseGradients(self.flag_board)] if sparse_embedding_params(self) else []
        return [c for c in made if type(c) not in have]

    def current_lr_factor(self) -> float:
        opt = self.optimizers(use_pl_optimizer=False)
        return opt.param_groups[0]["lr"] / self.optim_cfg["lr"]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # before the state loads: a per-rank checkpoint's head shards where its run directory now is
        shards_beside(checkpoint, self.trainer.ckpt_path if self._trainer is not None else None)

    def on_fit_start(self):
        install(self.body, self.head, self.compiled)  # here: in each process (ddp_spawn's workers too)

    def on_train_batch_start(self, batch, batch_idx):
        self.compiled.begin_step()

    def on_train_start(self):
        self._fit_start = time.perf_counter()

    def on_train_end(self):
        if not self.head.deferred_checks:
            self.loss_checks.read(self.global_step)

    def on_train_epoch_end(self):
        # Spawned workers do not hand global_step back to the launching process: this does.
        self.log("train/steps", float(self.global_step), sync_dist=True)  # equal on every rank

    # -- steps ----------------------------------------------------------------------
    def forward(self, context: Tensor) -> Tensor:
        return self.body(context)

    def training_step(self, batch, batch_idx):
        context, target = batch
        if self.head.self_updating:
            self.head.lr = self.head_base_lr * self.current_lr_factor()
        loss = self.head(*as_rows(self.body(context), target))
        # A head with deferred checks masks a non-finite step itself. A self-updating one without
        # is read now, before backward changes it; an ordinary head's loss every check_every steps, with
        # the app's other device flags (reading it every step would make every step wait for the GPU).
        if self.head.self_updating and not self.head.deferred_checks and not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss {loss.item()} at step {self.global_step}")
        if not self.head.deferred_checks:
            self.loss_checks.record(None if self.head.self_updating else loss, self.global_step)
        self.log("train/loss", loss.detach(), prog_bar=True)
        # wall-clock since fit start: learning curves against time (lst-compare)
        self.log("train/elapsed_s", time.perf_counter() - self._fit_start)
        if self.head.self_updating and self.global_step % max(self.trainer.log_every_n_steps, 1) == 0:
            self.log("head/lr", float(self.head.lr))
            self.log_dict({f"head/{k}": float(v) for k, v in self.head.logged_stats().items()
                           if isinstance(v, (int, float, bool)) or (torch.is_tensor(v) and v.numel() == 1)})
        return loss

    def _eval_step(self, batch, ranks: RankMetrics, ppl: Perplexity, mean_loss: WeightedMean, prefix: str):
        context, target = batch
        hidden, target = as_rows(self.body(context), target)
        # Rows with target -1 pad the shorter ranks' last batch (every rank must call a
        # distributed head equally often, with equal shapes), or a sequence past its
        # document's end: the metrics skip them.
        real = target >= 0 if target.dim() == 1 else (target >= 0).any(1)
        loss = self.head(hidden, target)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite {prefix} loss {loss.item()}")
        n = int(real.sum())
        if n:
            # the heads' mean is over all m rows (padding adds nothing), mean_real over the real ones
            scale = {"mean": len(target), "mean_real": n}.get(self.head.reduction, 1)
            total = loss * scale
            mean_loss.update(total.detach() / n, n)
        safe = target.clamp(min=0)  # padded rows are scored against class 0, then dropped
        ranks.update(self.head.target_rank(hidden, safe, self.score_chunk_size)[real])
        if self.perplexity:
            ppl.update(self.head.log_prob(hidden, safe)[real])

    def _eval_epoch_end(self, ranks: RankMetrics, ppl: Perplexity, mean_loss: WeightedMean, prefix: str):
        # compute() sums the states over ranks; sync_dist then only averages equal values
        # (and keeps Lightning from warning about unsynced epoch metrics).
        self.log(f"{prefix}/{LOSS}", mean_loss.compute(), sync_dist=True)
        mean_loss.reset()
        self.log_dict({f"{prefix}/{k}": v for k, v in ranks.compute().items()}, sync_dist=True)
        ranks.reset()
        if self.perplexity:
            self.log(f"{prefix}/{PERPLEXITY}", ppl.compute(), sync_dist=True)
            ppl.reset()
        if self.simlex is not None and hasattr(self.body, "input_embedding"):
            rho, n = simlex_spearman(whole(self.body.input_embedding.weight.detach()), self.simlex["index"],
                                     self.simlex["pairs"], set(self.simlex.get("skip", ())))
            if n >= 3:
                # the embeddings are equal on every rank: syncing only averages equal values
                rho_name, pairs_name = SIMLEX
                self.log(f"{prefix}/{rho_name}", rho, sync_dist=True)
                self.log(f"{prefix}/{pairs_name}", float(n), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, self.val_ranks, self.val_ppl, self.val_loss, "val")

    def on_validation_epoch_end(self):
        self._eval_epoch_end(self.val_ranks, self.val_ppl, self.val_loss, "val")
        # the step these val/* are from, for results.json (spawned workers hand callback_metrics back); no logger's
        self.log("val_step", float(self.trainer.global_step), logger=False, sync_dist=True)
        if self.trainer.state.fn == "fit":  # each validation point's own time: curves against time (W&B too)
            self.log("train/elapsed_s", time.perf_counter() - self._fit_start, sync_dist=True)
            clock = training_clock(self.trainer)
            if clock is not None:  # the run's training clock, validation left out: time-to-quality curves
                self.log("train/clock_s", float(clock.time_elapsed()), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, self.test_ranks, self.test_ppl, self.test_loss, "test")

    def on_test_epoch_end(self):
        self._eval_epoch_end(self.test_ranks, self.test_ppl, self.test_loss, "test")
