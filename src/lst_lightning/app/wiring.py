"""The run's loggers and callbacks, made from config: every entry of the ``logger`` and
``callbacks`` groups that has a ``_target_`` is instantiated, in the group's order, by one
loop (``instantiate_group``); the other entries are plain settings, the keys users type
(``logger.csv``, ``logger.wandb.mode``, ``callbacks.progress_every``, ...), which the
entries read by interpolation (conf/logger/*.yaml, conf/callbacks/*.yaml).

An entry's ``enabled: false`` leaves it out. The factories' settings have no defaults here:
their one source is the group's file. A target that takes ``run`` gets the build's
``Run`` (run directory, config, head, body, data module, the loggers made so far): the
factories below are the entries that need it; the others name a class directly.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested config -> flat ``{"a.b": v}`` (W&B shows and filters flat keys best)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class Run:
    """What the entries that take ``run`` may read while the run is being built."""
    cfg: DictConfig
    run_dir: Path
    name: str
    loss: str | None          # the spherical loss, None for the other heads
    head: object
    body: object
    dm: object
    loggers: list = field(default_factory=list)


def instantiate_group(group: DictConfig, run: Run) -> list:
    """The objects of every enabled ``_target_`` entry of ``group``, in order; an entry whose
    factory returns None (nothing to do in this run) is left out."""
    out = []
    for key, node in group.items():
        if not (OmegaConf.is_dict(node) and "_target_" in node):
            continue  # a setting the entries read
        settings = OmegaConf.to_container(node, resolve=True)
        if not settings.pop("enabled", True):
            continue
        try:
            target = get_object(settings["_target_"])
        except Exception as e:  # hydra wraps import errors
            raise ValueError(f"{key}._target_={settings['_target_']!r} cannot be imported: {e}") from e
        extra = {"run": run} if "run" in inspect.signature(target).parameters else {}
        # the settings by hydra, the run by the call (instantiate would turn it into a config)
        made = instantiate(settings, _partial_=True, _convert_="all")(**extra)
        if made is not None:
            out.append(made)
    return out


# -- loggers ------------------------------------------------------------------------------
def csv_logger(run: Run, name: str = "csv"):
    """The CSV logger that appends (spawned workers keep each other's rows): <run_dir>/csv."""
    from .csv_log import AppendingCSVLogger  # noqa: PLC0415

    return AppendingCSVLogger(save_dir=str(run.run_dir), name=name, version="")


def wandb_logger(run: Run, *, mode: str, project: str, entity: str | None, group: str | None, tags: list | tuple):
    """W&B, its run named after the run, grouped by ``group`` (default: the run name; a
    multirun's jobs get their sweep's, app/sweep_group.py), tagged with the head's class
    and the loss; the whole config as the run's flat config. A run resumed from its own
    directory's checkpoint continues that directory's W&B run (its id); any other run is a new one."""
    import lightning.pytorch as pl  # noqa: PLC0415

    from .resume import resumes_its_own_run  # noqa: PLC0415
    from .wandb_files import newest_run_id  # noqa: PLC0415

    tags = sorted({type(run.head).__name__, *([run.loss] if run.loss else []), *tags})
    run_id = newest_run_id(run.run_dir) if resumes_its_own_run(run.cfg.get("ckpt_path"), run.run_dir) else None
    return pl.loggers.WandbLogger(
        save_dir=str(run.run_dir), project=project, entity=entity, name=run.name, group=group or run.name,
        tags=tags, mode=mode, config=flatten(OmegaConf.to_container(run.cfg, resolve=True)), id=run_id)


# -- callbacks ----------------------------------------------------------------------------
def model_checkpoint(run: Run, *, every_n_steps: int, every_minutes: float | None, after_validation: bool,
                     keep: int, max_overhead: float | None, asynchronous: bool):
    """Checkpoints under <run_dir>/checkpoints: last.ckpt and the newest ``keep`` step<N>.ckpt,
    saved every ``every_minutes`` minutes, every ``every_n_steps`` steps, after every
    validation (each within ``max_overhead`` of the wall time), at the end and on SIGTERM
    (callbacks/periodic_checkpoint.py). ``asynchronous`` is read by ``train.build`` for the
    trainer's checkpoint IO (written in the background: checkpoint_io.py)."""
    from .callbacks import PeriodicCheckpoint  # noqa: PLC0415

    if not isinstance(asynchronous, bool):
        raise ValueError(f"callbacks.checkpoint.asynchronous must be true or false, got {asynchronous!r}")
    return PeriodicCheckpoint(dirpath=str(run.run_dir / "checkpoints"), every_n_steps=every_n_steps,
                              every_minutes=every_minutes, after_validation=after_validation, keep=keep,
                              max_overhead=max_overhead)


def progress_log(run: Run, *, every: int):
    """A log line every ``every`` steps and per validation, also in <run_dir>/train.log."""
    from .callbacks import ProgressLog  # noqa: PLC0415

    return ProgressLog(every=every, log_file=run.run_dir / "train.log")


def run_record(run: Run):
    """The run's facts as hyperparameters, its results as the W&B summary."""
    from .callbacks import RunRecord, run_facts  # noqa: PLC0415

    cfg = run.cfg
    return RunRecord(run_facts(run.head, run.body, run.dm.batch_size, run.loss, OmegaConf.to_container(cfg.loss.kwargs),
                               cfg.optimizer.lr, gpu=cfg.trainer.get("accelerator", "cpu") in ("gpu", "cuda"),
                               head_lr=cfg.optimizer.get("head_lr")))


def lr_monitor(run: Run, *, logging_interval: str):
    """The learning rate logged, when there is a logger."""
    import lightning.pytorch as pl  # noqa: PLC0415

    return pl.callbacks.LearningRateMonitor(logging_interval=logging_interval) if run.loggers else None
