"""The W&B group of a Hydra multirun: every job of one sweep in one group, however the
sweep was started (``lst-train -m`` with overrides, a ``+sweep=`` preset, Optuna).

A job of a multirun whose ``logger.wandb.group`` is null gets ``multirun/<the sweep
directory's last two parts>``: ``multirun/2026-11-23/21-40-00`` for Hydra's default
``hydra.sweep.dir`` (the same for every job: Hydra's ``now`` resolver is cached for the
sweep), ``multirun/zloss_ab/<time stamp>`` for a preset's. A group given in the config
or on the command line (the presets give one) is kept: it is the same for every job.
A single run (no ``-m``) keeps the default, its run name."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

W_AND_B_GROUP_CHARS = 128  # W&B's limit on a group name


def sweep_group(sweep_dir: str | Path) -> str:
    """``multirun/<last two parts of sweep_dir>``, at most 128 characters (its end kept)."""
    tail = "/".join(Path(sweep_dir).resolve().parts[-2:])
    return f"multirun/{tail}"[-W_AND_B_GROUP_CHARS:]


def group_the_sweep(cfg: DictConfig, sweep_dir: str | Path | None) -> None:
    """Set ``cfg.logger.wandb.group`` to the sweep's group when this is a job of a multirun
    (``sweep_dir`` given) and the config names none; otherwise leave ``cfg`` as it is."""
    if sweep_dir is None or not OmegaConf.is_dict(OmegaConf.select(cfg, "logger.wandb")):
        return
    if OmegaConf.select(cfg, "logger.wandb.group") is None:
        with open_dict(cfg):
            cfg.logger.wandb.group = sweep_group(sweep_dir)
