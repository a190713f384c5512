"""One LightningModule for any body and any output head.

Ordinary heads are trained by the optimizer with the body. Self-updating heads (the
factored and naive spherical heads) apply their exact SGD step inside
``loss.backward()``; their learning rate follows the body's schedule:
``head.lr = head_lr * current_lr / base_lr``, set before every step and logged.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..spherical.shard_files import load_rows, prune, save_shard
from ..heads.base import OutputHead
from .metrics import TOPK, Perplexity, RankMetrics, WeightedMean, simlex_spearman

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def lr_factor(step: int, *, name: str, warmup_steps: int, total_steps: int, min_factor: float) -> float:
    """The schedule as a multiple of the base lr (linear warm-up, then constant,
    linear or cosine decay to ``min_factor``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant" or total_steps <= warmup_steps:
        return 1.0
    t = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if name == "linear":
        return 1.0 - (1.0 - min_factor) * t
    if name == "cosine":
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"scheduler.name must be constant, linear or cosine, not {name!r}")


def check_distributed(head: OutputHead, world_size: int) -> None:
    """A self-updating head applies its own SGD step: DDP cannot average it, so with
    several processes the head must run its own collectives (``parallel``)."""
    if world_size <= 1 or not head.self_updating:
        return
    name = type(head).__name__
    if not hasattr(head, "distribute"):
        raise ValueError(f"{name} updates itself in backward and has no multi-process mode: "
                         f"it cannot train with {world_size} processes; use trainer=cpu or gpu (one process)")
    if getattr(head, "parallel", "none") == "none":
        raise ValueError(f"{name} with parallel=none would train a different head on each of the "
                         f"{world_size} processes: set head.parallel=replicated or sharded")


class _AppliedStep(torch.autograd.Function):
    """The loss of a head step already applied (``train_step`` or a replayed graph):
    backward hands the step's dL/dH on to the body."""

    @staticmethod
    def forward(ctx, hidden: Tensor, loss: Tensor, dH: Tensor) -> Tensor:
        ctx.save_for_backward(dH)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (dH,) = ctx.saved_tensors
        return dH * grad, None, None


HEAD_STEPS = ("autograd", "fused", "cuda_graph")


class LanguageModel(pl.LightningModule):
    def __init__(self, body: nn.Module, head: OutputHead, *, optimizer: dict | None = None,
                 scheduler: dict | None = None, head_lr: float | None = None, topk: Sequence[int] = TOPK,
                 perplexity: bool = False, score_chunk_size: int = 65536, simlex: dict | None = None,
                 timing_every: int = 10, head_step: str = "autograd", head_checkpoint: str = "whole",
                 head_shards_keep: int = 2):
        super().__init__()
        if not isinstance(head, OutputHead):
            raise TypeError(f"head must be an OutputHead, got {type(head).__name__}")
        if perplexity and not head.has_log_prob:
            raise ValueError(f"{type(head).__name__} (with this loss) defines no probabilities: "
                             "it cannot give perplexity; set metrics.perplexity=false or auto")
        self.body, self.head = body, head
        # How a self-updating head steps: in loss.backward() (autograd), or all at once in the
        # forward (fused: head.train_step; cuda_graph: that step replayed from a CUDA graph).
        # The last two assume the loss is backpropagated as is (gradient 1: no loss scaling).
        if head_step not in HEAD_STEPS:
            raise ValueError(f"head_step must be one of {HEAD_STEPS}, not {head_step!r}")
        if head_step != "autograd" and not hasattr(head, "train_step"):
            raise ValueError(f"head_step={head_step} needs a head with train_step (the factored head)")
        self.head_step, self._graph = head_step, None
        # A sharded V in checkpoints: "whole" (gathered on rank 0's host: portable, D d 4
        # bytes there) or "per_rank" (one file per rank beside the checkpoints, the newest
        # ``head_shards_keep`` saves kept: for D too large to gather).
        if head_checkpoint not in ("whole", "per_rank"):
            raise ValueError(f"head_checkpoint must be 'whole' or 'per_rank', not {head_checkpoint!r}")
        if head_shards_keep < 1:
            raise ValueError(f"head_shards_keep must be >= 1, got {head_shards_keep}")
        self.head_checkpoint, self.head_shards_keep = head_checkpoint, head_shards_keep
        self.optim_cfg = {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, **(optimizer or {})}
        if self.optim_cfg["name"] not in _OPTIMIZERS:
            raise ValueError(f"optimizer.name must be one of {sorted(_OPTIMIZERS)}, not {self.optim_cfg['name']!r}")
        self.sched_cfg = {"name": "constant", "warmup_steps": 0, "min_factor": 0.0, **(scheduler or {})}
        lr_factor(0, total_steps=1, **self.sched_cfg)  # rejects a bad name now
        self.head_lr = head_lr if head_lr is not None else getattr(head, "lr", None)
        if head.self_updating and self.head_lr is None:
            raise ValueError("a self-updating head needs a learning rate (head.lr)")
        self.perplexity, self.score_chunk_size = perplexity, score_chunk_size
        # simlex: {"pairs": [(a, b, score)], "index": {word: id}, "skip": [ids]}
        self.simlex = simlex
        self.timing_every = timing_every
        self.val_ranks, self.test_ranks = RankMetrics(topk), RankMetrics(topk)
        self.val_ppl, self.test_ppl = Perplexity(), Perplexity()
        self.val_loss, self.test_loss = WeightedMean(), WeightedMean()
        self._head_distributed = False
        self.timing = {"steps": 0, "step_s": 0.0, "head_s": 0.0, "tokens": 0}
        self._marks: dict[str, float] = {}
        self._timed = False
        self._fit_start = time.perf_counter()  # reset in on_train_start

    # -- multi-process ----------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Once torch.distributed is up (every rank): the head joins the process group,
        and DDP is told to leave its buffers alone. By default DDP would copy rank 0's
        buffers over every rank (at wrap time, every forward, and before validate/test):
        for the head's V (D x d) that is huge, and wrong when V is sharded. Ignoring
        them here, rather than ``broadcast_buffers=False`` in the strategy, covers
        every strategy config and the validate/test sync too, and still broadcasts the
        body's buffers."""
        world = self._trainer.world_size if self._trainer is not None else 1
        check_distributed(self.head, world)
        distribute = getattr(self.head, "distribute", None)
        if distribute is not None and not self._head_distributed:
            distribute()  # the default group: Lightning's
            self._head_distributed = True  # setup runs again for validate/test in the same processes
        if self.head.self_updating or distribute is not None:
            # the head keeps its replicas (or shards) consistent itself
            self._ddp_params_and_buffers_to_ignore = [f"head.{n}" for n, _ in self.head.named_buffers()]

    # -- optimisation ---------------------------------------------------------------
    def configure_optimizers(self):
        cfg = dict(self.optim_cfg)
        cls = _OPTIMIZERS[cfg.pop("name")]
        if cls is not torch.optim.SGD:
            cfg.pop("momentum", None)
        params = [p for p in self.parameters() if p.requires_grad]
        opt = cls(params, **cfg)
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, total_steps=int(total), **self.sched_cfg))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def current_lr_factor(self) -> float:
        opt = self.optimizers(use_pl_optimizer=False)
        return opt.param_groups[0]["lr"] / self.optim_cfg["lr"]

    # -- timing (the head's share of step time) ---------------------------------------
    def _now(self, key: str) -> None:
        if self._timed:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._marks[key] = time.perf_counter()

    def on_train_start(self):
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, batch, batch_idx):
        self._timed = self.timing_every > 0 and self.global_step % self.timing_every == 0
        self._now("start")

    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        self._now("backward")
        loss.backward(*args, **kwargs)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if not self._timed:
            return
        self._now("end")
        m = self._marks
        if {"hidden", "loss", "backward", "head_grad"} <= m.keys():
            step = m["end"] - m["start"]
            head = (m["loss"] - m["hidden"]) + (m["head_grad"] - m["backward"])
            n = batch[1].shape[0]
            self.log("train/tokens_per_s", n / step, prog_bar=True)
            self.log("train/head_share", head / step)
            self.log("train/step_ms", 1e3 * step)
            if self.global_step >= 2 * self.timing_every:  # skip warm-up steps in the totals
                t = self.timing
                t["steps"] += 1
                t["step_s"] += step
                t["head_s"] += head
                t["tokens"] += n
        self._marks = {}

    def on_train_epoch_end(self):
        # Spawned workers do not hand global_step back to the launching process: this does.
        self.log("train/steps", float(self.global_step), sync_dist=True)  # equal on every rank

    def _mark_head_grad(self, grad: Tensor) -> None:
        self._now("head_grad")

    # -- steps ----------------------------------------------------------------------
    def forward(self, context: Tensor) -> Tensor:
        return self.body(context)

    def training_step(self, batch, batch_idx):
        context, target = batch
        if self.head.self_updating:
            self.head.lr = self.head_lr * self.current_lr_factor()
        hidden = self.body(context)
        self._now("hidden")
        loss = self._head_loss(hidden, target)
        self._now("loss")
        if self._timed and hidden.requires_grad:
            hidden.register_hook(self._mark_head_grad)
        # A head with deferred checks masks a non-finite step itself; reading it here would
        # make every step wait for the GPU.
        if not getattr(self.head, "deferred_checks", False) and not torch.isfinite(loss):
            # Raise before backward: the self-updating head has not changed yet.
            raise FloatingPointError(f"non-finite training loss {loss.item()} at step {self.global_step}")
        self.log("train/loss", loss.detach(), prog_bar=True)
        # wall-clock since fit start: learning curves against time (lst-compare)
        self.log("train/elapsed_s", time.perf_counter() - self._fit_start)
        if self.head.self_updating and self.global_step % max(self.trainer.log_every_n_steps, 1) == 0:
            self.log("head/lr", float(self.head.lr))
            stats = self.head.stats() if hasattr(self.head, "stats") else {}
            self.log_dict({f"head/{k}": float(v) for k, v in stats.items()
                           if isinstance(v, (int, float, bool)) or (torch.is_tensor(v) and v.numel() == 1)})
        return loss

    def _head_loss(self, hidden: Tensor, target: Tensor) -> Tensor:
        if self.head_step == "autograd":
            return self.head(hidden, target)
        if self.head_step == "cuda_graph":
            if self._graph is None:
                from ..spherical.graph_step import CudaGraphStep  # noqa: PLC0415

                K = 1 if target.dim() == 1 else target.shape[1]
                self._graph = CudaGraphStep(self.head, hidden.shape[0], K, hidden_dtype=hidden.dtype)
            if hidden.shape[0] == self._graph.m:  # another batch size runs the same step eagerly
                return _AppliedStep.apply(hidden, *self._graph(hidden.detach(), target))
        return _AppliedStep.apply(hidden, *self.head.train_step(hidden.detach(), target))

    def _eval_step(self, batch, ranks: RankMetrics, ppl: Perplexity, mean_loss: WeightedMean, prefix: str):
        context, target = batch
        hidden = self.body(context)
        # Rows with target -1 pad the shorter ranks' last batch (every rank must call a
        # distributed head equally often, with equal shapes): the metrics skip them.
        real = target >= 0 if target.dim() == 1 else (target >= 0).any(1)
        loss = self.head(hidden, target)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite {prefix} loss {loss.item()}")
        n = int(real.sum())
        if n:
            # the heads' mean is over all m rows (padding adds nothing to softmax-type losses)
            total = loss * len(target) if getattr(self.head, "reduction", "mean") == "mean" else loss
            mean_loss.update(total.detach() / n, n)
        safe = target.clamp(min=0)  # padded rows are scored against class 0, then dropped
        ranks.update(self.head.target_rank(hidden, safe, self.score_chunk_size)[real])
        if self.perplexity:
            ppl.update(self.head.log_prob(hidden, safe)[real])

    def _eval_epoch_end(self, ranks: RankMetrics, ppl: Perplexity, mean_loss: WeightedMean, prefix: str):
        # compute() sums the states over ranks; sync_dist then only averages equal values
        # (and keeps Lightning from warning about unsynced epoch metrics).
        self.log(f"{prefix}/loss", mean_loss.compute(), sync_dist=True)
        mean_loss.reset()
        self.log_dict({f"{prefix}/{k}": v for k, v in ranks.compute().items()}, sync_dist=True)
        ranks.reset()
        if self.perplexity:
            self.log(f"{prefix}/perplexity", ppl.compute(), sync_dist=True)
            ppl.reset()
        if self.simlex is not None and hasattr(self.body, "input_embedding"):
            rho, n = simlex_spearman(self.body.input_embedding.weight, self.simlex["index"],
                                     self.simlex["pairs"], set(self.simlex.get("skip", ())))
            if n >= 3:
                # the embeddings are equal on every rank: syncing only averages equal values
                self.log(f"{prefix}/simlex_rho", rho, sync_dist=True)
                self.log(f"{prefix}/simlex_pairs", float(n), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, self.val_ranks, self.val_ppl, self.val_loss, "val")

    def on_validation_epoch_end(self):
        self._eval_epoch_end(self.val_ranks, self.val_ppl, self.val_loss, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, self.test_ranks, self.test_ppl, self.test_loss, "test")

    def on_test_epoch_end(self):
        self._eval_epoch_end(self.test_ranks, self.test_ppl, self.test_loss, "test")

    # -- exact resume: the global RNG (dropout) travels with the checkpoint ------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Every rank dumps the checkpoint (rank 0 writes it): a sharded head's V is
        # gathered there whole, so the checkpoint resumes on any number of ranks.
        if getattr(self.head, "sharded", False) and self.head_checkpoint == "per_rank":
            self._save_head_shard(checkpoint)
        elif getattr(self.head, "sharded", False) and hasattr(self.head, "gather_v"):
            V = self.head.gather_v()
            if V is not None:
                checkpoint["state_dict"]["head.V"] = V
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        checkpoint["rng_state"] = rng

    def _save_head_shard(self, checkpoint: dict) -> None:
        cb = self.trainer.checkpoint_callback
        root = Path(cb.dirpath if cb is not None and cb.dirpath else self.trainer.default_root_dir) / "head_shards"
        step_dir = root / f"step{self.global_step}"
        head = self.head
        save_shard(step_dir, self.global_rank, (head.row_lo, head.row_hi), head.V)
        checkpoint["state_dict"]["head.V"] = head.V.new_empty(0, head.V.shape[1]).cpu()
        checkpoint["head_shards"] = str(step_dir.resolve())
        self.trainer.strategy.barrier("head_shards")  # every shard written before any is pruned
        if self.global_rank == 0:
            prune(root, self.head_shards_keep)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        shards = checkpoint.get("head_shards")
        if shards is not None:  # this process's rows of V, from the per-rank files
            head = self.head
            lo, hi = (head.row_lo, head.row_hi) if getattr(head, "sharded", False) else (0, head.num_classes)
            checkpoint["state_dict"]["head.V"] = load_rows(shards, lo, hi)
        rng = checkpoint.get("rng_state")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
