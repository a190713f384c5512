"""The W&B report template of the papers' comparisons (``lst-dashboard --report``), with
W&B's own library (``wandb_workspaces.reports.v2``), one panel grid per comparison, each
over the runs of the W&B group its sweep or experiment logs to (read from conf/):

- factored vs naive: the same learning curve as a function of steps (Vincent et al.:
  the factored update is exact), and the factored head's lead in wall-clock time
  (``lst-train -m experiment=factored_vs_naive``);
- the spherical losses against the softmax baselines at equal wall-clock time
  (``lst-train -m +sweep=vs_softmax`` and ``+sweep=heads``);
- the Z-loss's a/b study (``lst-train -m +sweep=zloss_ab``; de Brebisson & Vincent).

The runsets name no entity or project: a report's panel grids read the report's own
project (as W&B's examples do), so the definition is the same offline and online.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from .configs import config_dir
from .wandb_panels import DEFAULT_METRIC, DEFAULT_TOPK, STEP, TIME, ab_panels, curve, group_filter, libraries

TITLE = "lst-lightning: the papers' comparisons"


def conf_group(path: str) -> str:
    """The W&B group a sweep or experiment config logs to (``logger.wandb.group``)."""
    return yaml.safe_load((Path(config_dir()) / path).read_text())["logger"]["wandb"]["group"]


def default_groups() -> dict[str, list[str]]:
    return {"factored_vs_naive": [conf_group("experiment/factored_vs_naive.yaml")],
            "vs_softmax": [conf_group("sweep/vs_softmax.yaml"), conf_group("sweep/heads.yaml")],
            "ab": [conf_group("sweep/zloss_ab.yaml")]}


def runset(name: str, groups: list[str]):
    _, wr = libraries()
    return wr.Runset(name=name, filters=group_filter(*groups))


def report(entity: str, project: str, groups: dict[str, list[str]] | None = None, metric: str = DEFAULT_METRIC,
           topk=DEFAULT_TOPK, title: str | None = None):
    """The report (``wandb_workspaces.reports.v2.Report``); ``groups`` maps each comparison
    (``factored_vs_naive``, ``vs_softmax``, ``ab``) to its W&B groups (default: conf/'s)."""
    _, wr = libraries()
    groups = {**default_groups(), **(groups or {})}
    errors = [f"val/top{k}_error" for k in topk]
    blocks = [
        wr.P("The comparisons of Vincent, de Brebisson & Bouthillier (2015) and de Brebisson & Vincent (2016), "
             "made with lst-lightning. Each panel grid shows the runs of its sweep's W&B group; the x axis is "
             f"the training step ({STEP}) or wall-clock seconds since training began ({TIME})."),
        wr.H2("Factored vs naive: the same curve, step for step"),
        wr.P("The factored head's update is exact, so its learning curves match the naive explicit-W head's as "
             "a function of steps (both keep W in float64); against wall-clock time the factored head is ahead. "
             "Runs: lst-train -m experiment=factored_vs_naive."),
        wr.PanelGrid(runsets=[runset("factored vs naive", groups["factored_vs_naive"])],
                     panels=[curve([y], STEP, grouped=False) for y in ["train/loss", *errors, "val/mrr"]]
                     + [curve([errors[0]], TIME, grouped=False)]),
        wr.H2("Spherical losses against softmax baselines, at equal wall-clock time"),
        wr.P("Each line is one head and loss (mean and range over its runs) against training seconds. "
             "Runs: lst-train -m +sweep=vs_softmax and lst-train -m +sweep=heads, with one time budget "
             "(trainer.max_time) for all."),
        wr.PanelGrid(runsets=[runset("spherical vs softmax", groups["vs_softmax"])],
                     panels=[curve([y], TIME) for y in [*errors, "val/mrr"]]
                     + [wr.BarPlot(title="steps done", metrics=["train_steps"]),
                        wr.BarPlot(title="mean step time (ms)", metrics=["step_time_ms"])]),
        wr.H2("The Z-loss's a/b study"),
        wr.P("a and b decide which top-k error the Z-loss favours. Runs: lst-train -m +sweep=zloss_ab "
             "(experiment=ab_study for the paper's setting)."),
        wr.PanelGrid(runsets=[runset("a/b study", groups["ab"])],
                     panels=ab_panels(metric, topk) + [curve([y], STEP, grouped=False) for y in errors]),
    ]
    return wr.Report(entity=entity, project=project, title=title or TITLE,
                     description="Factored vs naive, spherical losses vs softmax, the Z-loss's a/b study",
                     blocks=blocks)


def report_panels(r) -> list:
    _, wr = libraries()
    return [p for b in r.blocks if isinstance(b, wr.PanelGrid) for p in b.panels]


def report_definition(r) -> dict:
    """What ``Report.save()`` sends W&B (the report's spec), with where it would go."""
    model = r._to_model()  # save() serialises this model; wandb-workspaces has no public form of it
    return {"kind": "report", "entity": r.entity, "project": r.project, "title": r.title,
            "description": r.description,
            "spec": json.loads(model.spec.model_dump_json(by_alias=True, exclude_none=True))}


def report_outline(r) -> str:
    _, wr = libraries()
    lines = [f"W&B report {r.title!r} in {r.entity or '<your default entity>'}/{r.project}:"]
    for b in r.blocks:
        if isinstance(b, wr.H2):
            lines.append(f"  {b.text}:")
        elif isinstance(b, wr.PanelGrid):
            lines.append(f"    runs: {' and '.join(rs.filters for rs in b.runsets)}")
            lines += [f"    {type(p).__name__}: {p.title}" for p in b.panels]
    return "\n".join(lines)
