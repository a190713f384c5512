"""The checks of ``lst-train``'s configuration that need neither Lightning nor the data, so
that a typo is answered in seconds rather than after their ~20 s of imports and reading: the
trainer's numbers, the checkpoint to resume from, local data files, the keys of the loss
group, the head's own settings, the optimiser's and the schedule's names (their own checks:
torch), the objective.
Each error names the setting and says what to do."""
from __future__ import annotations

import math
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf

from .configs import config_dir
from .resume import NEWEST, resolve_ckpt_path


def _whole(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _fraction(v) -> bool:
    return isinstance(v, float) and 0.0 <= v <= 1.0


def _duration(v) -> bool:
    """Lightning's time-based form "DD:HH:MM:SS" (training time between validations)."""
    parts = v.split(":") if isinstance(v, str) else []
    return len(parts) == 4 and all(p.isdigit() for p in parts) and any(int(p) for p in parts)


def _devices(v) -> bool:
    """Lightning's forms of ``devices``: a count (>= 1, or -1 for all), auto, or device indices
    (a list, or a string such as "0,1")."""
    if v in ("auto", -1, "-1") or _whole(v, 1):
        return True
    if isinstance(v, list):
        return len(v) > 0 and all(_whole(i, 0) for i in v)
    return isinstance(v, str) and all(p.strip().isdigit() for p in v.rstrip(",").split(","))


# trainer.<key>: (accepts the value?, what it must be). Lightning checks these too, after its import.
TRAINER_NUMBERS = {
    "max_steps": (lambda v: _whole(v, -1), "a whole number >= 0, or -1 for no limit"),
    "max_epochs": (lambda v: v is None or _whole(v, -1), "a whole number >= 0, -1 for no limit, or null"),
    "min_steps": (lambda v: v is None or _whole(v, 0), "a whole number >= 0, or null"),
    "min_epochs": (lambda v: v is None or _whole(v, 0), "a whole number >= 0, or null"),
    "limit_train_batches": (lambda v: v is None or _whole(v, 0) or _fraction(v),
                            "a number of batches (>= 0), a fraction in [0.0, 1.0], or null for all"),
    "limit_val_batches": (lambda v: v is None or _whole(v, 0) or _fraction(v),
                          "a number of batches (>= 0), a fraction in [0.0, 1.0], or null for all"),
    "limit_test_batches": (lambda v: v is None or _whole(v, 0) or _fraction(v),
                           "a number of batches (>= 0), a fraction in [0.0, 1.0], or null for all"),
    "val_check_interval": (lambda v: v is None or _whole(v, 1) or (_fraction(v) and v > 0) or _duration(v),
                           ("a number of steps (>= 1), a fraction of an epoch in (0.0, 1.0], "
                            "a training time DD:HH:MM:SS, or null")),
    "check_val_every_n_epoch": (lambda v: v is None or _whole(v, 1), "a whole number >= 1, or null"),
    "max_time": (lambda v: v is None or _duration(v), "a training time DD:HH:MM:SS (validation excluded), or null"),
    "accumulate_grad_batches": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "devices": (_devices, "a number of devices (>= 1, or -1 for all), auto, or device indices such as [0,1]"),
    "num_nodes": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "log_every_n_steps": (lambda v: _whole(v, 1), "a whole number >= 1"),
    "num_sanity_val_steps": (lambda v: _whole(v, -1), "a whole number >= 0, or -1 for all"),
    "gradient_clip_val": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
                          "a number >= 0, or null for no clipping"),
}


#: ``seed``: the largest numpy (and so ``seed_everything``) takes
MAX_SEED = 2 ** 32 - 1

#: ``clock``: the clocks a time budget counts on (app/callbacks/time_budget.py's ``CLOCKS``)
CLOCK_NAMES = ("wall", "cpu")


def _number(v, lo: float = 0.0, hi: float = float("inf"), open_lo: bool = False) -> bool:
    """A finite number in the range (inf and nan are no setting: an lr of inf trains to nan)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v > lo if open_lo else v >= lo) and v <= hi)


# The numbers of the other groups without a schema (their names, such as optimizer.name, are
# checked by the code that reads them): <group>.<key>: (accepts the value?, what it must be).
GROUP_NUMBERS = {
    "optimizer": {
        "lr": (lambda v: _number(v, open_lo=True), "a number > 0"),
        "momentum": (lambda v: _number(v, 0.0, 1.0), "a number in [0, 1]"),
        "weight_decay": (lambda v: _number(v), "a number >= 0"),
        "embedding_lr": (lambda v: v is None or _number(v, open_lo=True), "a number > 0, or null for optimizer.lr"),
        "head_lr": (lambda v: v is None or _number(v, open_lo=True), "a number > 0, or null for optimizer.lr"),
    },
    "scheduler": {
        "warmup_steps": (lambda v: _whole(v, 0), "a whole number >= 0"),
        "min_factor": (lambda v: _number(v, 0.0, 1.0), "a number in [0, 1]"),
    },
    "metrics": {
        "topk": (lambda v: isinstance(v, list) and len(v) > 0 and all(_whole(k, 1) for k in v),
                 "a list of whole numbers >= 1, such as [1,10]"),
        "simlex": (lambda v: isinstance(v, bool), "true or false"),
        "perplexity": (lambda v: v == "auto" or isinstance(v, bool), "auto, true or false"),
        "score_chunk_size": (lambda v: _whole(v, 1), "a whole number >= 1"),
        "timing_every": (lambda v: _whole(v, 0), "a whole number >= 0 (0: off)"),
    },
}


def check_numbers(section: DictConfig | None, table: dict, group: str) -> None:
    values = OmegaConf.to_container(section, resolve=True) if section is not None else {}
    for key, (ok, want) in table.items():
        if key in values and not ok(values[key]):
            raise ValueError(f"{group}.{key}={values[key]!r}: must be {want}")


def check_trainer(trainer: DictConfig) -> None:
    check_numbers(trainer, TRAINER_NUMBERS, "trainer")


def check_ckpt_path(ckpt_path) -> None:
    """A file must exist; ``last`` and ``auto`` are looked up in the run directory by ``build``."""
    if ckpt_path and str(ckpt_path) not in NEWEST:
        resolve_ckpt_path(ckpt_path, ".")


def loss_settings() -> set[str]:
    """The keys of the loss group (``name``, ``kwargs``)."""
    from .schemas import LOSS_KEYS  # noqa: PLC0415

    return set(LOSS_KEYS)


def loss_parameters() -> set[str]:
    """The parameters some loss takes under ``loss.kwargs`` (a, b, eps...): the losses' own."""
    from .schemas import loss_parameters  # noqa: PLC0415  (the losses: torch)

    return loss_parameters()


def check_loss_key(key: str, value: str = "...") -> None:
    """``loss.<key>`` must be a setting of the loss group: a loss's parameter is
    ``loss.kwargs.<key>`` (Hydra would suggest ``+loss.<key>``, a key nothing reads)."""
    name = key.split(".", 1)[0]
    if name in loss_settings():
        return
    if name in loss_parameters():
        raise ValueError(f"loss.{key} is not a setting: the loss's parameters are under loss.kwargs; "
                         f"write loss.kwargs.{key}={value}")
    raise ValueError(f"loss.{key} is not a setting of the loss group (it has {', '.join(sorted(loss_settings()))}; "
                     "the loss's parameters are loss.kwargs.<name>)")


# Keys that are gone: the key, and what to write instead (one line, before Hydra answers
# with its hint to append the old key).
GONE = {
    "head_step": "the step mode is the head's own setting: write head.step={value}",
    "loss.head_lr": ("a self-updating head's SGD lr is head.lr (null: the loss's own default): "
                     "write head.lr={value}"),
}


def check_gone(key: str, value: str = "...") -> None:
    if key in GONE:
        raise ValueError(f"{key} is no longer a setting: {GONE[key].format(value=value)}")


def heads_of(args: list[str]) -> list[DictConfig]:
    """The head configs ``args`` choose (each of ``head=a,b``; an ``experiment=``'s), composed
    without the other overrides; none when they do not compose (Hydra then says why). Inside
    the app (a sweep's jobs: sweep_checks.py) they compose on its Hydra, its search path."""
    from contextlib import ExitStack  # noqa: PLC0415

    from hydra import compose, initialize_config_dir  # noqa: PLC0415
    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415
    from hydra.errors import HydraException  # noqa: PLC0415

    choice = {k.lstrip("+"): v for k, _, v in (a.partition("=") for a in args) if k.lstrip("+") in ("head", "experiment")}
    heads = choice.get("head", "").split(",") if "head" in choice else [None]
    base = [f"experiment={choice['experiment']}"] if "experiment" in choice else []
    try:
        with ExitStack() as stack:
            if not GlobalHydra.instance().is_initialized():
                stack.enter_context(initialize_config_dir(config_dir=config_dir(), version_base="1.3"))
            return [compose("config", overrides=base + ([f"head={h}"] if h else [])).head for h in heads]
    except HydraException:
        return []


def check_head_lr(args: list[str]) -> None:
    """``head.lr=`` is a self-updating head's own SGD lr: for a head whose config has no
    ``lr`` (an ordinary head, trained by the optimizer), say to write ``optimizer.head_lr``
    rather than Hydra's hint to append ``+head.lr``."""
    value = next((a.partition("=")[2] for a in args if a.partition("=")[0] == "head.lr"), None)
    if value is None:
        return
    for head in heads_of(args):
        if "lr" not in head:
            name = str(head.get("_target_")).rsplit(".", 1)[-1]
            raise ValueError(f"head.lr={value}: head.lr is a self-updating head's own SGD lr; {name} is "
                             f"trained by the optimizer, its parameters' lr is optimizer.head_lr "
                             f"(write optimizer.head_lr={value})")


def check_overrides(args: Iterable[str]) -> None:
    """Command-line overrides, before Hydra composes them: ``loss.a=-1`` names the right key."""
    args = list(args)
    check_head_lr(args)
    check_negatives(args)
    check_preconditioner(args)
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        check_gone(key, value)
        if key.startswith("loss."):
            check_loss_key(key[len("loss."):], value)


def other_loss(args: list[str]) -> str | None:
    """The loss a command line chooses when it is one other than ``sampled`` (whose head files
    turn the negatives and the preconditioner on); None for the default or a sweep."""
    losses = [a.split("=", 1)[1] for a in args if a.lstrip("+~").startswith("loss=")]
    return None if not losses or losses[-1] == "sampled" or "," in losses[-1] else losses[-1]


def check_negatives(args: list[str]) -> None:
    """``head.negatives.*`` with another loss than ``sampled`` (the loss that turns them on):
    one line, not Hydra's assertion on a null node."""
    loss = other_loss(args)
    for arg in args if loss else ():
        if arg.lstrip("+~").startswith("head.negatives."):
            raise ValueError(f"{arg}: head.negatives are the sampled classes of loss=sampled (the default); "
                             f"with loss={loss} there are none (drop loss={loss}, or this override)")


def check_preconditioner(args: list[str]) -> None:
    """``head.preconditioner.*`` with another loss than ``sampled`` and no
    ``head/preconditioner=sampled``: one line, not Hydra's assertion on a null node."""
    loss = other_loss(args)
    if loss is None or any(a.lstrip("+~").startswith("head/preconditioner=") for a in args):
        return
    for arg in args:
        if arg.lstrip("+~").startswith("head.preconditioner."):
            raise ValueError(f"{arg}: the preconditioner is on with loss=sampled (the default); with "
                             f"loss={loss} turn it on first: head/preconditioner=sampled {arg}")


def check_data(data: DictConfig) -> None:
    if data.get("source") == "files":
        from ..data.files import text_files  # noqa: PLC0415  (pathlib only)

        text_files(OmegaConf.to_container(data.path) if OmegaConf.is_config(data.path) else data.path)


def check_objective(objective, test: bool, metrics: DictConfig | None = None, written: list[str] | None = None) -> None:
    """``objective`` names ``<split>/<metric>`` of results.json: a split the run writes (val;
    test unless test=false) and a metric it writes there: one of ``written``, or with the
    ``metrics`` group one it can write (run_keys.split_metrics); before training rather than
    when the run's results are in."""
    import difflib  # noqa: PLC0415

    from .run_keys import split_metrics  # noqa: PLC0415

    if not objective:
        return
    split, _, metric = str(objective).partition("/")
    splits = ("val", "test") if test else ("val",)
    if split not in splits or not metric:
        raise ValueError(f"objective={objective!r}: must be <split>/<metric> of results.json with the split "
                         f"{' or '.join(splits)}{'' if test else ' (test=false)'}, such as val/top5_error")
    if written is None and metrics is not None:
        written = split_metrics(metrics.topk, metrics.get("perplexity") is not False, bool(metrics.get("simlex")))
    if written is not None and metric not in written:
        near = difflib.get_close_matches(metric, written, n=1)
        hint = f"did you mean {split}/{near[0]}? " if near else ""
        raise ValueError(f"objective={objective!r}: this run writes no {split}/{metric}; {hint}the choices are "
                         f"{', '.join(f'{split}/{m}' for m in written)}")


def check_names(cfg: DictConfig) -> None:
    """The optimiser's names (``optimizer.name``, ``.embedding``, ``.head_rows``), the lr
    schedule's (``scheduler.name``, ``.over``) and ``compile``, by the checks that LanguageModel
    and the compiling make of them, before the data is read rather than after."""
    from .compiling import check_setting as check_compile  # noqa: PLC0415  (torch)
    from .optimizers import check_optimizer_config, embedding_for  # noqa: PLC0415
    from .schedule import lr_factor  # noqa: PLC0415

    check_compile(cfg.get("compile", "auto"))

    if cfg.get("optimizer") is not None:
        optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True)
        # embedding=auto as lst-train may choose it (a run that does not compile, on the CPU)
        check_optimizer_config({**optimizer, "embedding": embedding_for(optimizer.get("embedding", "dense"), False)})
    if cfg.get("scheduler") is not None:
        lr_factor(0, total_steps=1, **OmegaConf.to_container(cfg.scheduler, resolve=True))  # as LanguageModel does


def check_head_settings(head: DictConfig | None) -> None:
    """The head's settings that its class checks one by one (spherical/settings.py's ``Setting``:
    ``head.lr``, ``head.weight_decay``, ``head.clip_norm``...) and those of its step's driving,
    together (``Driving``: ``head.step``, ``head.sync_every``...), by those checks, before the data
    is read rather than when the head is built; null is the code's default (``make_head``), and
    ``head.step=auto`` lst-train's choice (step_choice.py)."""
    import dataclasses  # noqa: PLC0415

    from hydra.utils import get_class  # noqa: PLC0415

    from ..spherical.driving import Driving  # noqa: PLC0415  (torch)
    from ..spherical.settings import Driven, Setting  # noqa: PLC0415
    from .step_choice import AUTO  # noqa: PLC0415

    try:
        cls = get_class(str(head.get("_target_"))) if head is not None else None
    except Exception:  # hydra wraps import errors: build names the class that does not import
        return
    values = {str(k): v for k, v in (OmegaConf.to_container(head, resolve=True) if cls is not None else {}).items()}
    for key, value in values.items():
        setting = getattr(cls, key, None)
        if value is not None and isinstance(setting, Setting):
            try:
                setting.check(value)
            except ValueError as e:
                raise ValueError(f"head.{key}={value!r}: {e}") from None
    fields = {f.name for f in dataclasses.fields(Driving)}
    driven = {k: getattr(cls, k).field for k in values if isinstance(getattr(cls, k, None), Driven)}
    driving = {driven.get(k, k): v for k, v in values.items() if driven.get(k, k) in fields
               and v is not None and not (k == "step" and v == AUTO)}
    if driven:  # a head whose step is driven by its settings (the factored head)
        try:
            Driving(**driving)
        except ValueError as e:
            raise ValueError(f"head: {e}") from None


def check_config(cfg: DictConfig) -> None:
    """Everything about ``cfg`` that can be checked before torch and Lightning are imported."""
    OmegaConf.to_container(cfg, resolve=True)  # an interpolation that does not resolve, named by its key
    for key in GONE:
        if OmegaConf.select(cfg, key, default=GONE) is not GONE:  # an old experiment's config
            check_gone(key, OmegaConf.select(cfg, key))
    check_trainer(cfg.trainer)
    for group, table in GROUP_NUMBERS.items():
        check_numbers(cfg.get(group), table, group)
    check_ckpt_path(cfg.get("ckpt_path"))
    for key in cfg.get("loss") or {}:
        check_loss_key(str(key))
    seed = cfg.get("seed")
    if not _whole(seed, 0) or seed > MAX_SEED:  # the data's seed too: ${seed}; numpy's bound (seed_everything)
        raise ValueError(f"seed={seed!r}: must be a whole number in [0, {MAX_SEED}]")
    threads = cfg.get("cpu_threads")
    if threads is not None and not _whole(threads, 1):
        raise ValueError(f"cpu_threads={threads!r}: must be a whole number >= 1, or null for torch's choice")
    if cfg.get("clock", "wall") not in CLOCK_NAMES:
        raise ValueError(f"clock={cfg.get('clock')!r}: must be {' or '.join(CLOCK_NAMES)}")
    from ..spherical.shard_files import check_checkpoint_settings  # noqa: PLC0415  (torch: after the checks above)

    check_checkpoint_settings(cfg.get("head_checkpoint", "whole"), cfg.get("head_shards_keep", 2))
    check_head_settings(cfg.get("head"))
    check_names(cfg)
    check_objective(cfg.get("objective"), cfg.get("test", True), cfg.get("metrics"))
    check_data(cfg.data)
