"""``lst-train``: the Hydra entry point. ``build`` checks the configuration and makes
the data module, the LightningModule and the trainer (every bad input fails here,
before training); ``run`` trains, validates, tests, prints a summary table and writes
``results.json`` in the run directory.

This module does not import Lightning at the top (torch only, for the heads' schemas that
the configs extend: ``schemas.py``): ``--help``, ``--cfg`` and the configuration checks of
``checks.py`` answer before those ~20 s of imports, and bad input ends the console script
with one line and exit code 2 (``errors.py``)."""
from __future__ import annotations

import inspect
import json
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from .checks import check_config, check_objective, check_overrides
from .compiling import choose as compile_choice
from .compiling import run_refusal
from .composition import composed, raising
from .optimizers import embedding_for
from .configs import config_dir
from .errors import exit_on_bad_input
from .preemption import exit_on_preemption
from .quiet import one_handler_for_lightning, quiet_libraries, show_our_lines
from .resume import resolve_ckpt_path
from .run_lock import holding
from .schemas import not_null_defaults
from .setting_types import check_setting_types
from .step_choice import AUTO, choose_step
from .sweep_checks import refusals
from .wiring import Run, instantiate_group

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def check_device(trainer_cfg: DictConfig) -> None:
    import torch  # noqa: PLC0415

    acc = str(trainer_cfg.get("accelerator", "cpu"))
    if acc in ("gpu", "cuda"):
        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError(f"trainer.accelerator={acc} but no CUDA device is visible; use trainer=cpu")
        devices = trainer_cfg.get("devices", 1)
        if isinstance(devices, int) and devices > n:
            raise ValueError(f"trainer.devices={devices} but only {n} CUDA device(s) are visible")
    elif acc == "mps" and not torch.backends.mps.is_available():
        raise ValueError("trainer.accelerator=mps but MPS is not available here")


#: the Trainer's arguments that ``build`` gives from other settings
BUILT_TRAINER_ARGS = {"logger": "the logger group", "callbacks": "the callbacks group",
                      "enable_checkpointing": "callbacks.checkpoint.enabled", "default_root_dir": "hydra.run.dir",
                      "enable_progress_bar": "callbacks.rich_progress", "plugins": "callbacks.checkpoint.asynchronous"}


def check_trainer_keys(trainer_cfg: DictConfig) -> None:
    """Each key of the trainer group is an argument of Lightning's ``Trainer`` that ``build`` does
    not give itself (``+trainer.max_step=5``: one line naming the nearest, not the Trainer's
    TypeError after the data is read)."""
    import difflib  # noqa: PLC0415

    import lightning.pytorch as pl  # noqa: PLC0415

    takes = [p for p in inspect.signature(pl.Trainer.__init__).parameters if p != "self"]
    for key in trainer_cfg:
        if key in BUILT_TRAINER_ARGS:
            raise ValueError(f"trainer.{key} is lst-train's to give the Trainer: set {BUILT_TRAINER_ARGS[key]}")
        if key not in takes:
            near = difflib.get_close_matches(str(key), takes, n=1)
            raise ValueError(f"trainer.{key}: Lightning's Trainer takes no {key}"
                             + (f"; did you mean trainer.{near[0]}?" if near else ""))


def head_class(cfg: DictConfig) -> type:
    try:
        return get_class(cfg.head._target_)
    except Exception as e:  # hydra wraps import errors
        raise ValueError(f"head._target_={cfg.head._target_!r} cannot be imported: {e}") from e


def model_class(cfg: DictConfig) -> type:
    try:
        return get_class(cfg.model._target_)
    except Exception as e:  # hydra wraps import errors
        raise ValueError(f"model._target_={cfg.model._target_!r} cannot be imported: {e}") from e


def make_head(cfg: DictConfig, num_classes: int, hidden_dim: int, class_counts: torch.Tensor):
    """``instantiate(cfg.head, num_classes=D, hidden_dim=d, **extra)``; ``class_counts``
    only where the constructor takes it, or where its unigram negatives draw from it; a null
    setting whose code default is not null left out: the code's default (``schemas.not_null_defaults``)."""
    cls = head_class(cfg)
    if not getattr(cls, "self_updating", False) and cfg.head.get("lr") is not None:
        raise ValueError(f"head.lr={cfg.head.lr}: head.lr is a self-updating head's own SGD lr; {cls.__name__} is "
                         f"trained by the optimizer, its parameters' lr is optimizer.head_lr "
                         f"(write optimizer.head_lr={cfg.head.lr})")
    params = inspect.signature(cls).parameters
    extra = {"class_counts": class_counts} if "class_counts" in params else {}
    # null for a setting whose default is not (dtype=torch.float32): the code's default
    head_cfg = OmegaConf.to_container(cfg.head, resolve=True)
    for name in not_null_defaults(cls) & {k for k, v in head_cfg.items() if v is None}:
        del head_cfg[name]
    if head_cfg.get("step") == AUTO:
        del head_cfg["step"]  # the code's default until the trainer is built (choose_step)
    negatives = head_cfg.get("negatives")
    if isinstance(negatives, dict) and negatives.get("sampler") == "unigram" and negatives.get("class_counts") is None:
        extra["negatives"] = {**negatives, "class_counts": class_counts}  # the spherical heads' unigram: the data's
    head_cfg = OmegaConf.create({"head": head_cfg}).head  # its errors name the key: head
    return instantiate(head_cfg, num_classes=num_classes, hidden_dim=hidden_dim, _convert_="all", **extra)


def loss_name(cfg: DictConfig) -> str | None:
    """The spherical loss the head trains with (the loss group); None for the heads
    outside the spherical family, which take none."""
    from ..spherical import SphericalHeadBase  # noqa: PLC0415

    return str(cfg.loss.name) if issubclass(head_class(cfg), SphericalHeadBase) else None


def unused_loss(cfg: DictConfig, overrides: Sequence[str]) -> str | None:
    """A line for overrides of the ``loss`` group (``loss=zloss``, ``loss.kwargs.mu=0.3``) given to a
    head outside the spherical family, which takes no spherical loss; None where the head takes it."""
    chosen = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "loss"]
    if not chosen or loss_name(cfg) is not None:
        return None
    return (f"{' '.join(chosen)}: {head_class(cfg).__name__} takes no spherical loss, so the setting is not used "
            "(the factored and naive heads take one)")


def task_overrides() -> list[str]:
    """This job's command-line overrides (a sweep's: this point's), or none outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run_name(cfg: DictConfig) -> str:
    if cfg.get("name"):
        return str(cfg.name)
    cls, loss = head_class(cfg), loss_name(cfg)
    return f"{cls.__name__}-{loss}" if loss else cls.__name__


def check_accumulation(cfg: DictConfig, head) -> None:
    """Gradient accumulation needs a head that can take one exact step for all the micro-batches
    at the optimizer's step (the HeadSteps callback): the head says whether it can."""
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    why = head.cannot_accumulate() if accumulate != 1 else None
    if why:
        raise ValueError(f"{type(head).__name__} cannot wait for the optimizer's step: {why}; "
                         f"trainer.accumulate_grad_batches={accumulate} must be 1")


def check_graph_step(head, trainer) -> None:
    """``head.step=cuda_graph`` replays the head's step from a CUDA graph: a run on another
    device is refused before training, in one line."""
    device = trainer.strategy.root_device
    if getattr(head, "step", None) == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"head.step=cuda_graph replays the head's step from a CUDA graph, but this run trains on "
                         f"{device.type}: use trainer=gpu, or head.step=fused on {device.type}")


def check_strategy(trainer) -> None:
    """Several processes train under DDP (ddp, ddp_spawn, ddp_fork) or with the body sharded by
    FSDP2 (``strategy=fsdp2``: fsdp_body.py; docs/multi_gpu.md); the other strategies that
    shard the parameters (Lightning's FSDP, DeepSpeed, tensor parallelism) are refused."""
    from lightning.pytorch.strategies import (  # noqa: PLC0415
        DDPStrategy,
        DeepSpeedStrategy,
        ModelParallelStrategy,
        ParallelStrategy,
    )

    from .fsdp_body import NAME as FSDP2  # noqa: PLC0415
    from .fsdp_body import check_fsdp2  # noqa: PLC0415

    s = trainer.strategy
    if isinstance(s, ModelParallelStrategy):
        check_fsdp2(s)
        return
    if isinstance(s, ParallelStrategy) and (not isinstance(s, DDPStrategy) or isinstance(s, DeepSpeedStrategy)):
        raise ValueError(f"{type(s).__name__} is not supported: lst-train runs several processes under DDP, or with "
                         f"the body sharded by FSDP2 and the head out of it (trainer.strategy={FSDP2}); the head "
                         "has no parameters for FSDP1 or DeepSpeed to shard (it steps itself in backward); for a "
                         "head too large for one GPU use head.parallel=sharded (docs/multi_gpu.md)")


def check_built(cfg: DictConfig, dm, module, trainer) -> None:
    """Every check of the built run that needs the objects themselves, in one place, before
    any process is started: the strategy, the head with accumulation, a graph step on its
    device, the head and the processes, a sharded head and spawn, a callback that averages the
    head's buffers (``+callbacks.<name>._target_``), a training split that fills no batch of
    the world's."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: PLC0415

    from .callbacks.head_steps import check_weight_averaging  # noqa: PLC0415
    from .module import check_distributed  # noqa: PLC0415

    head = module.head
    check_strategy(trainer)
    check_weight_averaging(trainer.callbacks, [head])
    check_accumulation(cfg, head)
    check_graph_step(head, trainer)
    check_distributed(head, trainer.world_size)
    dm.check_one_batch(len(dm.splits["train"]), trainer.world_size)  # spawned workers would raise it as a traceback
    if getattr(head, "parallel", "none") == "sharded" and isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
        # The workers hand the model back through rank 0's state_dict: one shard of V.
        raise ValueError(f"head.parallel=sharded cannot run under trainer.strategy={cfg.trainer.strategy}: spawned "
                         "workers return only rank 0's shard of V to the launching process; use "
                         "trainer.strategy=ddp (trainer=ddp on one node, or torchrun/srun: docs/multi_gpu.md)")


def build(cfg: DictConfig, run_dir: str | Path, extra_callbacks: Sequence = ()):
    """Data module, model and trainer from a composed config: the loggers and callbacks are
    the ``_target_`` entries of the ``logger`` and ``callbacks`` groups (wiring.py); the
    built run is checked by ``check_built``."""
    check_config(cfg)  # the checks that need no torch, before its import and Lightning's
    quiet_libraries()
    import lightning.pytorch as pl  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from .checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO  # noqa: PLC0415
    from .metrics import read_simlex  # noqa: PLC0415
    from .module import LanguageModel  # noqa: PLC0415
    from .run_keys import split_metrics  # noqa: PLC0415

    one_handler_for_lightning()
    if pl.utilities.rank_zero_only.rank == 0:
        show_our_lines()  # head.step=auto's choice shown where nothing configured logging
    run_dir = Path(run_dir)
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), run_dir)  # ckpt_path=last with nothing to resume fails here
    tcfg = cfg.trainer
    check_trainer_keys(tcfg)
    check_device(tcfg)
    head_class(cfg)  # a bad _target_ fails here, before the data is read
    if pl.utilities.rank_zero_only.rank == 0 and (note := unused_loss(cfg, task_overrides())):
        log.warning(note)  # head=sampled loss=zloss: a sweep over both groups runs the same head twice
    check_setting_types(cfg.data, get_class(cfg.data._target_), "data")  # data.vocab_size=abc: one line
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))

    # A body that reads whole sequences (the transformer) gets them from the data module.
    sequences = bool(getattr(model_class(cfg), "reads_sequences", False))
    dm = instantiate(cfg.data, _convert_="all", **({"sequences": True} if sequences else {}))
    dm.prepare_data()
    dm.setup("fit")
    body = instantiate(cfg.model, vocab_size=dm.input_vocab_size, context_size=dm.context_size, _convert_="all")
    head = make_head(cfg, dm.num_classes, body.hidden_dim, dm.class_counts)

    m = cfg.metrics
    perplexity = head.has_log_prob if m.perplexity == "auto" else m.perplexity  # auto, true or false: check_config
    simlex = None
    if m.simlex and getattr(dm, "vocab", None) is not None:
        simlex = {"pairs": read_simlex(), "index": dm.vocab.index, "skip": [dm.vocab.unk_id]}
    # the objective among the metrics this head, body and data write (no val/perplexity without probabilities)
    check_objective(cfg.get("objective"), cfg.get("test", True), written=split_metrics(
        m.topk, bool(perplexity), simlex is not None and hasattr(body, "input_embedding")))
    run = Run(cfg, run_dir, run_name(cfg), loss_name(cfg), head, body, dm)
    run.loggers = instantiate_group(cfg.logger, run)
    callbacks = instantiate_group(cfg.callbacks, run) + list(extra_callbacks)
    from .fsdp_body import NAME as FSDP2  # noqa: PLC0415
    from .fsdp_body import fsdp2_strategy  # noqa: PLC0415

    trainer_kwargs = OmegaConf.to_container(tcfg, resolve=True)
    if trainer_kwargs.get("strategy") == FSDP2:  # Lightning has no string for it
        trainer_kwargs["strategy"] = fsdp2_strategy()
    callbacks += time_bounded(trainer_kwargs, cfg.get("clock") or "wall")
    trainer = pl.Trainer(
        **trainer_kwargs, logger=run.loggers or False, callbacks=callbacks,
        # callbacks.checkpoint.enabled=false saves nothing (not Lightning's own checkpoint instead)
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=str(run_dir), enable_progress_bar=bool(cfg.callbacks.rich_progress),
        # files replaced atomically, written in the background by default (checkpoint_io.py)
        plugins=[AsyncAtomicCheckpointIO() if OmegaConf.select(cfg, "callbacks.checkpoint.asynchronous", default=True)
                 else AtomicCheckpointIO()],
    )
    # optimizer.embedding=auto: row_adam where the run compiles or trains on a GPU, else sparse_adam
    device, setting = trainer.strategy.root_device, cfg.get("compile", False)
    optimizer = OmegaConf.to_container(cfg.optimizer)
    optimizer["embedding"] = embedding_for(optimizer.get("embedding", "dense"), run_refusal(
        setting, device, trainer.world_size, trainer.accumulate_grad_batches) is None, device)
    module = LanguageModel(
        body, head, optimizer=optimizer, scheduler=OmegaConf.to_container(cfg.scheduler),
        topk=list(m.topk), perplexity=perplexity, score_chunk_size=m.score_chunk_size, simlex=simlex,
    )
    if cfg.head.get("step") == AUTO:
        choose_step(module.head, trainer)
    check_built(cfg, dm, module, trainer)
    if ckpt is not None:
        from .checkpoint_fit import check_fits  # noqa: PLC0415

        check_fits(cfg, module, ckpt, getattr(getattr(dm, "vocab", None), "words", None))  # another model's (or
        # another corpus's) checkpoint: one line, before the run writes anything
    module.compiled = compile_choice(setting, body, module.head, device, trainer.world_size,
                                     trainer.accumulate_grad_batches)
    if pl.utilities.rank_zero_only.rank == 0 and (module.compiled.any or device.type == "cuda"):
        log.info("compile=%s: %s", cfg.get("compile"), module.compiled.describe())
    return dm, module, trainer


def time_bounded(trainer_kwargs: dict, clock: str = "wall") -> list:
    """``trainer.max_time`` as the run's bound: its ``TrainingClock`` (training time, validation
    excluded, on the ``clock``: "wall" or "cpu") in place of Lightning's ``Timer``, and the trainer preset's epochs no cap (the
    epochs go on until the time is spent, or ``trainer.max_steps``). Without a budget, a clock
    other than the wall's still counts (a time-based ``trainer.val_check_interval`` on it, and
    ``train/clock_s``). Changes ``trainer_kwargs``; returns the callbacks to add."""
    import lightning.pytorch as pl  # noqa: PLC0415

    from .callbacks.time_budget import TrainingClock  # noqa: PLC0415

    budget = trainer_kwargs.pop("max_time", None)
    if budget is None:
        return [] if clock == "wall" else [TrainingClock(None, clock)]
    if pl.utilities.rank_zero_only.rank == 0 and trainer_kwargs.get("max_epochs") not in (None, -1):
        log.info("trainer.max_time=%s: training time on the %s clock, validation excluded; the epochs (trainer.max_epochs=%s) "
                 "do not cap it, trainer.max_steps=%s does", budget, clock, trainer_kwargs["max_epochs"],
                 trainer_kwargs.get("max_steps", -1))
    trainer_kwargs["max_epochs"] = -1
    return [TrainingClock(budget, clock)]


def unigram_metrics(dm, topk, limit_batches: int | float = 1.0, world_size: int = 1) -> dict[str, float]:
    """The unigram baseline on the examples the model's test saw: every rank's shard of the
    test split, each cut to the trainer's ``limit_test_batches`` (an int: batches per rank; a
    float: that fraction of them, rounded down, as Lightning does)."""
    from itertools import islice  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from .metrics import Perplexity, RankMetrics, unigram_ranks  # noqa: PLC0415

    ranks, ppl = RankMetrics(topk), Perplexity()
    logp = torch.log(dm.class_counts.double() / dm.class_counts.sum())
    for rank in range(world_size):  # all ranks' shards, on whichever rank asks
        loader = dm.eval_dataloader("test", rank, world_size)
        n = min(len(loader), limit_batches) if isinstance(limit_batches, int) else int(len(loader) * limit_batches)
        for _, target in islice(loader, n):
            target = target[target >= 0]  # a shard's padding; sequences: past a document's end
            ranks.update(unigram_ranks(dm.class_counts, target))
            ppl.update(logp[target])
    out = {k: float(v) for k, v in ranks.compute().items()}
    out["perplexity"] = float(ppl.compute())
    return out


def run(cfg: DictConfig, run_dir: str | Path, extra_callbacks: Sequence = ()) -> dict:
    """Train (or resume), validate, test; returns and writes the results.

    Multi-process: under ``ddp_spawn`` this runs in the launching process and each
    trainer call starts the workers; under an external launcher (torchrun, SLURM with
    ``strategy=ddp``) it runs on every rank and only global rank 0 writes files."""
    start = time.perf_counter()
    with holding(run_dir):  # one run at a time in a directory
        return fit_and_test(cfg, run_dir, build(cfg, run_dir, extra_callbacks), start)


def fit_and_test(cfg: DictConfig, run_dir: str | Path, built: tuple, start: float) -> dict:
    """``run`` after ``build``: ``built`` is its (data module, model, trainer); ``start``
    the ``time.perf_counter()`` the run's wall time counts from."""
    from .callbacks import HeadTiming, PeriodicCheckpoint, RunRecord  # noqa: PLC0415

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dm, module, trainer = built
    writer = trainer.is_global_zero
    if writer:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if getattr(dm, "vocab", None) is not None:
            dm.save_vocab(run_dir / "vocab.json")
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), run_dir)  # last, auto: the run's newest (resume.py)
    if writer and ckpt_path is None:  # a fresh start: an earlier run's CSV log in this directory is not this run's
        from .csv_log import AppendingCSVLogger  # noqa: PLC0415

        for logger in trainer.loggers:
            if isinstance(logger, AppendingCSVLogger) and logger.start_afresh():
                log.warning("a fresh start in %s: the earlier run's %s/metrics.csv replaced (ckpt_path=last "
                            "resumes a run and continues its log)", run_dir, Path(logger.log_dir).name)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    # under ddp_spawn global_step stays 0 here (the workers trained)
    steps = trainer.global_step or int(trainer.callback_metrics.get("train/steps", 0))
    if not trainer.global_step and steps:  # the loggers' step of the validation and test that follow
        trainer.fit_loop.epoch_loop._batches_that_stepped = steps
    val = {k[4:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    val_step = trainer.callback_metrics.get("val_step")
    val_step = int(val_step) if val and val_step is not None else None
    if val_step != steps and trainer.limit_val_batches != 0:
        # the last validation before the end of training (val_check_interval, max_steps mid-epoch), or none
        out = trainer.validate(module, datamodule=dm, verbose=False)  # [] when no batch is run
        val = {k[4:]: float(v) for k, v in (out[0] if out else {}).items() if k.startswith("val/")}
        val_step = steps if val else None  # under ddp_spawn the workers' global_step is 0 here
    results: dict = {"name": run_name(cfg), "head": type(module.head).__name__, "loss": loss_name(cfg),
                     "num_classes": dm.num_classes, "val": val, "val_step": val_step,
                     "train_steps": steps}
    if isinstance(getattr(module.head, "step", None), str):  # the factored head's step as it ran (head.step=auto)
        results["head_step"] = module.head.step
    results["compiled"] = module.compiled.describe()  # what compile= compiled (compiling.py)
    if cfg.get("test", True):
        test = trainer.test(module, datamodule=dm, verbose=False)[0]
        results["test"] = {k[5:]: float(v) for k, v in test.items() if k.startswith("test/")}
        results["unigram_test"] = unigram_metrics(dm, list(cfg.metrics.topk), trainer.limit_test_batches,
                                                  trainer.world_size)
    timing = next((c for c in trainer.callbacks if isinstance(c, HeadTiming)), None)  # callbacks.head_timing
    t = timing.totals if timing is not None else {"steps": 0}
    if t["steps"]:
        results["step_time_ms"] = 1e3 * t["step_s"] / t["steps"]
        results["tokens_per_s"] = t["tokens"] / t["step_s"]
        results["head_share"] = t["head_s"] / t["step_s"]
    saver = next((c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoint)), None)  # callbacks.checkpoint
    if saver is not None and saver.overhead is not None:
        results["checkpoints"] = saver.overhead
    results["wall_s"] = time.perf_counter() - start
    results["run_dir"] = str(run_dir)
    results["world_size"] = trainer.world_size
    record = next((c for c in trainer.callbacks if isinstance(c, RunRecord)), None)  # callbacks.run_record
    results.update(record.facts if record is not None else {})
    results.update({f"head/{k}": float(v) for k, v in module.head.stats().items()})  # final counters
    if record is not None:
        record.finish(trainer, results)  # the W&B summary, under results.json's names
    if writer:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2))
        print_summary(results)
    return results


def print_summary(results: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    cols = [c for c in ("val", "test", "unigram_test") if c in results]
    table = Table(title=f"{results['name']}  (D={results['num_classes']}, {results['train_steps']} steps)")
    table.add_column("metric")
    for c in cols:
        table.add_column(c, justify="right")
    keys = list(dict.fromkeys(k for c in cols for k in results[c]))
    for k in keys:
        table.add_row(k, *(f"{results[c][k]:.4g}" if k in results[c] else "" for c in cols))
    console = Console()
    console.print(table)
    run_wide = [f"{k} {results[k]:.4g}" for k in ("step_time_ms", "tokens_per_s", "head_share", "wall_s") if k in results]
    if run_wide:  # the run's, not a split's: below the table, not in its first split's column
        console.print(", ".join(run_wide))
    run_dir = Path(results["run_dir"]).resolve()
    console.print(f"Run directory: {run_dir}\nResults: {run_dir / 'results.json'}", soft_wrap=True)


def swept_overrides(hc) -> list[str]:
    """In a Hydra multirun, this job's values of the swept keys: those of
    ``hydra.sweeper.params`` and the command-line overrides with several values
    (read from the sweep's multirun.yaml)."""
    from hydra.types import RunMode  # noqa: PLC0415

    if hc.mode != RunMode.MULTIRUN:
        return []

    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    keys = {str(k).lstrip("+~") for k in (hc.sweeper.get("params") or {})}
    multirun = Path(hc.sweep.dir) / "multirun.yaml"
    if multirun.is_file():
        sweep_task = OmegaConf.load(multirun).hydra.overrides.task
        keys |= {key(o) for o in sweep_task if "," in o.split("=", 1)[-1] or "(" in o.split("=", 1)[-1]}
    task = list(hc.overrides.task)
    return [o for o in task if key(o) in keys] if keys else task


@hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415
    from hydra.types import RunMode  # noqa: PLC0415
    from omegaconf import open_dict  # noqa: PLC0415

    from .sweep_group import group_the_sweep  # noqa: PLC0415

    composed()  # from here Hydra reports what is raised, as it does for any app
    hc = HydraConfig.get()
    start = time.perf_counter()
    with ExitStack() as held:
        with exit_on_bad_input("lst-train"):  # bad input: one line, exit code 2
            check_config(cfg)  # in a second, before the heavy imports of build()
            held.enter_context(holding(hc.runtime.output_dir))  # one run at a time in a directory, until the job ends
            resolve_ckpt_path(cfg.get("ckpt_path"), hc.runtime.output_dir)  # ckpt_path=last with nothing there
            swept = swept_overrides(hc)
            if swept:  # one W&B run per job: the run name says which point of the sweep it is
                with open_dict(cfg):
                    cfg.name = f"{run_name(cfg)}[{','.join(swept)}]"
            group_the_sweep(cfg, hc.sweep.dir if hc.mode == RunMode.MULTIRUN else None)  # one W&B group per sweep
            built = build(cfg, hc.runtime.output_dir)
        try:
            with exit_on_preemption(hc.runtime.output_dir):  # SIGTERM, a first Ctrl-C: last.ckpt saved, exit 143, 130
                results = fit_and_test(cfg, hc.runtime.output_dir, built, start)
        except FloatingPointError as e:
            if not cfg.get("objective"):
                raise
            # a diverged trial is a bad point of the search, not the end of it
            log.warning("trial diverged, objective = inf: %s", e)
            return float("inf")
        return objective(cfg, results)


def objective(cfg: DictConfig, results: dict) -> float | None:
    """The number an Optuna sweep minimises: ``objective: test/top5_error`` names a
    ``<split>/<metric>`` of results.json (null: none)."""
    key = cfg.get("objective")
    if not key:
        return None
    split, _, metric = str(key).partition("/")
    try:
        return float(results[split][metric])
    except (KeyError, TypeError) as e:
        have = sorted(f"{s}/{m}" for s in ("val", "test") for m in results.get(s, {}))
        raise ValueError(f"objective={key!r} is not in this run's results; have {have}") from e


def main() -> None:
    with exit_on_bad_input("lst-train"):
        check_overrides(sys.argv[1:])  # before Hydra, whose hint for loss.a=1 is +loss.a=1
    with exit_on_bad_input("lst-train"), raising(), refusals():  # head=nosuch, data.batch_sise=3: one line too
        _hydra_main()  # a sweep's every job checked before the first starts: sweep_checks.py


if __name__ == "__main__":
    main()
