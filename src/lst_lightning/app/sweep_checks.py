"""Every job of a multirun checked before the first one starts: ``lst-train -m head.lr=1,-1``
refuses job #1's ``head.lr=-1`` in one line before job #0 trains, not after it.

``CheckEveryJob`` is a Hydra callback (``hydra.callbacks`` in conf/config.yaml). At
``on_multirun_start``, before the sweeper launches anything, it lists the sweep's jobs as the
sweeper does (``hydra.sweeper.params``, then the command line's overrides, split by Hydra's
``BasicSweeper.split_arguments``), composes each as the launcher does (``load_sweep_config``),
and applies lst-train's checks of the overrides and of the composed config (checks.py). The
Optuna sweeper draws its trials as it goes: the checks see its fixed overrides with each
value of a ``choice`` or ``range`` and both ends of an ``interval``, one searched key at a
time. The jobs of another sweeper are checked as each starts.

Hydra turns an exception of a callback into a warning and goes on: a refusal leaves the
callback as ``Refused`` (no ``Exception``), and ``refusals()``, around the Hydra app in
``main``, raises its error again there, where bad input becomes one line (errors.py)."""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def sweep_arguments(config: DictConfig) -> list[str]:
    """What the sweepers sweep: ``hydra.sweeper.params`` as ``key=value``, then the command
    line's overrides (the later wins)."""
    params = config.hydra.sweeper.get("params") or {}
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)  # name=${...} as written
    return [f"{k}={v}" for k, v in params.items()] + task


def grid_jobs(overrides: list) -> list[list[str]]:
    """The basic sweeper's jobs: every combination of the swept values, in its order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # noqa: PLC0415

    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def trial_values(override) -> list[str]:
    """The values an Optuna trial may give ``override``'s key: its fixed value, each of a choice
    or range, an interval's two ends."""
    if not override.is_sweep_override():
        return [override.get_value_element_as_str()]
    if override.is_interval_sweep():
        interval = override.value()
        return [str(interval.start), str(interval.end)]
    return list(override.sweep_string_iterator())


def trial_jobs(overrides: list) -> list[list[str]]:
    """Optuna's trials as far as they are known before it draws them: the first value of every
    key, then each other value of each key with the others at their first."""
    values = {o.get_key_element(): trial_values(o) for o in overrides}
    first = {key: vs[0] for key, vs in values.items()}
    jobs = [first] + [{**first, key: v} for key, vs in values.items() for v in vs[1:]]
    return [[f"{key}={v}" for key, v in job.items()] for job in jobs]


def sweep_jobs(config: DictConfig, loader) -> tuple[str, list[list[str]]]:
    """The sweep's jobs (each its overrides) and what to call one: every job of the basic
    sweeper, Optuna's trials as ``trial_jobs`` has them, none for another sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: PLC0415

    sweeper = config.hydra.sweeper.get("_target_")
    if sweeper not in (BASIC, OPTUNA):
        return "job", []
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(sweep_arguments(config))
    return ("job", grid_jobs(overrides)) if sweeper == BASIC else ("trial", trial_jobs(overrides))


def check_job(config: DictConfig, job: list[str], loader) -> None:
    """lst-train's checks of one job: its overrides (checks.check_overrides), then its config as
    the launcher composes it, its ``hydra`` node as the job sees it (checks.check_config)."""
    from hydra.core.hydra_config import HydraConfig  # noqa: PLC0415

    from .checks import check_config, check_overrides  # noqa: PLC0415

    check_overrides(job)
    job_cfg = loader.load_sweep_config(config, job)
    held = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(job_cfg)  # ${hydra:...} in the job's config reads its own
    try:
        task_cfg = copy.deepcopy(job_cfg)
        with open_dict(task_cfg):
            del task_cfg["hydra"]
        check_config(task_cfg)
    finally:
        HydraConfig.instance().cfg = held


def check_every_job(config: DictConfig) -> None:
    """Each job of the multirun ``config`` through ``check_job``: the first refused raises
    a ValueError naming the job and its overrides, before any job has started."""
    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415

    from .errors import bad_input_message  # noqa: PLC0415

    loader = GlobalHydra.instance().config_loader()
    kind, jobs = sweep_jobs(config, loader)
    for n, job in enumerate(jobs):
        try:
            check_job(config, job, loader)
        except Exception as e:
            msg = bad_input_message(e)
            if msg is None:
                raise
            which = f"job #{n} of {len(jobs)}" if kind == "job" else "a trial"
            raise ValueError(f"{which} ({' '.join(job)}): {msg}") from e


class Refused(BaseException):
    """A job refused by ``check_every_job``, past Hydra's handling of a callback's exceptions."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


@contextmanager
def refusals() -> Iterator[None]:
    """The error of a job refused inside the block, raised again as itself."""
    try:
        yield
    except Refused as refused:
        raise refused.error from refused.error.__cause__


class CheckEveryJob(Callback):
    """``check_every_job`` at the start of a multirun, before the sweeper launches a job."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_every_job(config)
        except Exception as e:
            raise Refused(e) from None
