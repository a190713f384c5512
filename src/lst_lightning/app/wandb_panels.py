"""The W&B panels of this project's comparisons, built with W&B's own library for
workspaces and reports (``wandb-workspaces``, the ``dashboard`` extra), shared by the
saved workspace of a sweep (``dashboard.py``) and the report template (``report.py``);
and the keys every panel names, to check them against what the runs logged.

The keys are those a run logs (names: app/run_keys.py): history ``val/top5_error``,
``train/step_ms``, ``head/folds``...; summary ``test/top5_error``, ``step_time_ms``...;
config ``a``, ``b``, ``head_loss``... Two of W&B's defaults would mislead here, so every
panel names its axis: W&B's ``Step`` counts logging calls (Lightning logs the training
step as ``trainer/global_step``), and config keys with dots are taken as nested (the
run's flat Hydra keys such as ``loss.kwargs.a`` would be looked up as
``loss.value.kwargs.a``): the panels use the flat top-level facts instead."""
from __future__ import annotations

from types import ModuleType

from ..spherical.stabiliser import REPAIR_COUNTERS

STEP = "trainer/global_step"  # the training step
TIME = "train/elapsed_s"  # wall-clock seconds since the start of training, logged with every row
DEFAULT_METRIC = "test/top5_error"
DEFAULT_TOPK = (1, 5, 50)
GROUP_CURVES = "head_loss"  # learning curves group runs by head and loss
INSTALL = "uv sync --extra dashboard, or pip install 'lst-lightning[dashboard]'"
# W&B's own x axes, logged by W&B itself
BUILTIN_X = {"Step", "RelativeTime(Wall)", "RelativeTime(Process)", "WallTime"}


def libraries() -> tuple[ModuleType, ModuleType]:
    """``(wandb_workspaces.workspaces, wandb_workspaces.reports.v2)``, imported on demand."""
    try:
        import wandb_workspaces.reports.v2 as wr  # noqa: PLC0415
        import wandb_workspaces.workspaces as ws  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"W&B dashboards need wandb-workspaces, which is not installed ({INSTALL})") from e
    return ws, wr


def curve(y: list[str], x: str = STEP, title: str | None = None, grouped: bool = True, log_y: bool = False):
    """A line plot of history keys against the training step or wall-clock seconds;
    ``grouped``: one line per head and loss (mean, with the min-max band over runs)."""
    _, wr = libraries()
    group = {"groupby": wr.Config(GROUP_CURVES), "groupby_aggfunc": "mean", "groupby_rangefunc": "minmax"}
    return wr.LinePlot(title=title or f"{', '.join(y)} against {'wall-clock s' if x == TIME else 'step'}", x=x, y=y,
                       title_x="training seconds (wall clock)" if x == TIME else "step", log_y=log_y or None,
                       **(group if grouped else {}))


def ab_panels(metric: str = DEFAULT_METRIC, topk=DEFAULT_TOPK) -> list:
    """The a/b study: a, b -> the test top-k errors, and ``metric`` over a and b."""
    _, wr = libraries()
    column = wr.ParallelCoordinatesPlotColumn
    return [
        wr.ParallelCoordinatesPlot(
            title="Z-loss a, b -> test top-k error",
            columns=[column(wr.Config("a"), display_name="a", log=True), column(wr.Config("b"), display_name="b"),
                     *[column(wr.SummaryMetric(f"test/top{k}_error"), display_name=f"top-{k} error") for k in topk]]),
        wr.ScatterPlot(title=f"{metric} over a and b", x=wr.Config("a"), y=wr.Config("b"), z=wr.SummaryMetric(metric),
                       log_x=True),
    ]


def learning_curve_panels(topk=DEFAULT_TOPK, grouped: bool = True) -> list:
    """Validation top-k errors and MRR against the step and against wall-clock seconds."""
    ys = [f"val/top{k}_error" for k in topk] + ["val/mrr"]
    return ([curve([y], STEP, grouped=grouped) for y in ys] + [curve(["train/loss"], STEP, grouped=grouped)]
            + [curve([y], TIME, grouped=grouped) for y in ys])


def cost_panels() -> list:
    """Step time, tokens per second and the head's share of the step: along training, and
    each run's mean over its timed steps (results.json's names)."""
    _, wr = libraries()
    along = [curve(["train/step_ms"], title="step time (ms)"), curve(["train/tokens_per_s"], title="tokens per second"),
             curve(["train/head_share"], title="head's share of the step")]
    means = [wr.BarPlot(title=title, metrics=[key], orientation="h")
             for key, title in (("step_time_ms", "mean step time (ms)"), ("tokens_per_s", "mean tokens per second"),
                                ("head_share", "mean head share"))]
    return along + means


def health_panels() -> list:
    """The head's repairs, its condition estimate and bound, and the steps it skipped."""
    return [curve([f"head/{c}" for c in REPAIR_COUNTERS], title="repairs and checks (counts)", grouped=False),
            curve(["head/cond_estimate", "head/cond_bound"], title="condition of U (estimate, bound)", grouped=False,
                  log_y=True),
            curve(["head/skipped_nonfinite"], title="skipped steps (non-finite)", grouped=False)]


def group_filter(*groups: str):
    """Runs of the W&B groups (a sweep's ``logger.wandb.group``)."""
    ws, _ = libraries()
    group = ws.Metric("Group")
    return ws.And(group == groups[0] if len(groups) == 1 else group.isin(list(groups)))


def named_keys(panel) -> list[tuple[str, str]]:
    """``(section, key)`` for every run key ``panel`` names; section is ``history``,
    ``summary`` or ``config`` (W&B's own x axes left out)."""
    _, wr = libraries()

    def kind(m, default: str) -> tuple[str, str]:
        if isinstance(m, wr.Config):
            return "config", m.name
        if isinstance(m, wr.SummaryMetric):
            return "summary", m.name
        return default, m.name if isinstance(m, wr.Metric) else m

    if isinstance(panel, wr.LinePlot):
        out = [kind(m, "history") for m in [panel.x, *panel.y] if m not in BUILTIN_X]
        return out + ([kind(panel.groupby, "config")] if panel.groupby else [])
    if isinstance(panel, wr.ScatterPlot):
        return [kind(m, "summary") for m in (panel.x, panel.y, panel.z) if m is not None]
    if isinstance(panel, wr.ParallelCoordinatesPlot):
        return [kind(c.metric, "summary") for c in panel.columns]
    if isinstance(panel, wr.BarPlot):
        return [kind(m, "summary") for m in panel.metrics]
    raise TypeError(f"named_keys does not know {type(panel).__name__}")


def panel_keys(panels: list) -> list[tuple[str, str]]:
    return [key for p in panels for key in named_keys(p)]


def column_key(column: str) -> tuple[str, str]:
    """``(section, key)`` of a runs-table column (``config:a.value``, ``summary:wall_s``)."""
    section, _, name = column.partition(":")
    return section, name.removesuffix(".value") if section == "config" else name


def missing_keys(named: list[tuple[str, str]], logged: dict[str, set[str]]) -> list[str]:
    """The ``(section, key)`` of ``named`` that no run logged, as ``section:key``;
    ``logged`` is ``{"config": keys, "summary": keys, "history": keys}`` over the runs
    (wandb_files.WandbRun.keys)."""
    missing = []
    for section, key in named:
        if key not in logged.get(section, ()) and f"{section}:{key}" not in missing:
            missing.append(f"{section}:{key}")
    return missing
