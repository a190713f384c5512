"""``lst-dashboard``: a sweep's W&B workspace (a saved view of its project), and with
``--report`` the report template of the papers' comparisons (report.py), both defined
with W&B's own library (``wandb-workspaces``: ``uv sync --extra dashboard``).

The workspace shows the runs of one W&B group (a sweep's ``logger.wandb.group``) in four
sections: the a/b study, learning curves, cost and the head's health (wandb_panels.py).
Given a sweep directory it reads the entity, project and group from the sweep's W&B
offline runs (W&B's own reader) and checks that every key a panel names was logged by
some run. Online it saves the view and prints its address; ``--dry-run`` (offline)
writes the definition W&B would receive as JSON, beside the sweep, and prints what it
would create.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import OneLineParser
from .run_files import read_config
from .wandb_files import read_runs
from .wandb_panels import (
    DEFAULT_METRIC,
    DEFAULT_TOPK,
    STEP,
    ab_panels,
    cost_panels,
    group_filter,
    health_panels,
    learning_curve_panels,
    libraries,
    column_key,
    missing_keys,
    panel_keys,
)

SECTIONS = ("a/b study", "learning curves", "cost", "head health")


def workspace(entity: str, project: str, group: str, metric: str = DEFAULT_METRIC, topk=DEFAULT_TOPK,
              name: str | None = None):
    """The workspace (``wandb_workspaces.workspaces.Workspace``) of one group's runs."""
    ws, _ = libraries()
    panels = {"a/b study": ab_panels(metric, topk), "learning curves": learning_curve_panels(topk),
              "cost": cost_panels(), "head health": health_panels()}
    columns = ["config:head.value", "config:loss.value", "config:a.value", "config:b.value", "config:D.value",
               *[f"summary:test/top{k}_error" for k in topk], "summary:test/mrr", "summary:step_time_ms",
               "summary:wall_s"]
    return ws.Workspace(
        entity=entity, project=project, name=name or f"lst-lightning {group}",
        sections=[ws.Section(name=s, panels=panels[s], is_open=True, panel_settings=ws.SectionPanelSettings(x_axis=STEP))
                  for s in SECTIONS],
        settings=ws.WorkspaceSettings(x_axis=STEP, max_runs=100),
        runset_settings=ws.RunsetSettings(filters=group_filter(group), pinned_columns=columns))


def workspace_definition(w) -> dict:
    """What ``Workspace.save()`` sends W&B (the view's spec), with where it would go."""
    view = w._to_model()  # save() serialises this model; wandb-workspaces has no public form of it
    return {"kind": "workspace", "entity": w.entity, "project": w.project, "name": w.name,
            "spec": json.loads(view.spec.model_dump_json(by_alias=True, exclude_none=True))}


def panels_of(w) -> list:
    return [p for s in w.sections for p in s.panels]


def workspace_keys(w) -> list[tuple[str, str]]:
    """``(section, key)`` of every run key the workspace names: its panels' and its runs
    table's pinned columns (W&B's own run attributes left out)."""
    columns = [column_key(c) for c in w.runset_settings.pinned_columns if not c.startswith("run:")]
    return panel_keys(panels_of(w)) + columns


def outline(w, group: str) -> str:
    lines = [f"W&B workspace {w.name!r} in {w.entity or '<your default entity>'}/{w.project}, runs of group {group!r}:"]
    for s in w.sections:
        lines.append(f"  {s.name}:")
        lines += [f"    {type(p).__name__}: {p.title}" for p in s.panels]
    return "\n".join(lines)


def sweep_target(sweep: Path, given: tuple = (None, None, None)) -> tuple[str | None, str | None, str | None, list]:
    """(entity, project, group, W&B runs) of a sweep directory: from its W&B offline runs,
    else from the config.yaml lst-train wrote in each run (``logger.wandb``; the group
    defaults to the run name, and in a multirun to the sweep's: app/sweep_group.py). Each of
    ``given`` (--entity, --project, --group) that is set stands, and must be one of the runs' (a
    group no run of the sweep logged to would show an empty workspace); one its runs differ in
    must be given."""
    runs = read_runs(sweep)
    if runs:
        targets = {(r.config.get("logger.wandb.entity"), r.project, r.group) for r in runs}
    else:
        targets = set()
        for path in sweep.rglob("config.yaml"):
            if ".hydra" in path.relative_to(sweep).parts:
                continue  # Hydra's copy, composed before lst-train named the run and its sweep's group
            cfg = read_config(path)
            wb = (cfg.get("logger") or {}).get("wandb") or {}
            if wb:
                targets.add((wb.get("entity"), wb.get("project"), wb.get("group") or cfg.get("name")))
    if not targets:
        raise ValueError(f"{sweep} holds no W&B offline run and no lst-train config.yaml")
    chosen, differ = [], []
    for flag, value, found in zip(("--entity", "--project", "--group"), given, zip(*targets)):
        if value and value not in found and None not in found:  # None: a run that leaves it to W&B's default
            raise ValueError(f"no run under {sweep} goes to {flag} {value}: they have {sorted(set(found))}")
        chosen.append(value or (found[0] if len(set(found)) == 1 else None))
        if not chosen[-1] and len(set(found)) > 1:
            differ.append(f"{flag} (they have {sorted(set(found), key=str)})")
    if differ:
        raise ValueError(f"the runs under {sweep} go to several W&B places: give {', '.join(differ)}")
    return (*chosen, runs)


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(prog="lst-dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", nargs="?", type=Path, help="a sweep (multirun) directory: entity, project and group "
                    "come from its runs, and the dry-run JSON goes beside it")
    ap.add_argument("--entity", help="W&B entity (default: the sweep's, else your default entity)")
    ap.add_argument("--project", help="W&B project (default: the sweep's)")
    ap.add_argument("--group", help="W&B run group (default: the sweep's)")
    ap.add_argument("--metric", default=DEFAULT_METRIC, help="the metric shown over a and b (default: %(default)s)")
    ap.add_argument("--topk", default=",".join(map(str, DEFAULT_TOPK)),
                    help="the top-k errors in the panels (default: %(default)s)")
    ap.add_argument("--name", help="the workspace's (or report's) name")
    ap.add_argument("--report", action="store_true", help="the report template of the papers' comparisons "
                    "instead (report.py; its groups are those conf/ gives the sweeps)")
    ap.add_argument("--dry-run", action="store_true", help="offline: write the definition as JSON and print it")
    ap.add_argument("-o", "--out", type=Path, help="the dry run's JSON file (default: wandb_workspace.json "
                    "or wandb_report.json, in the sweep directory or here)")
    args = ap.parse_args(argv)
    import wandb  # noqa: PLC0415

    try:
        built, definition, text, missing = build(args)
        if missing:
            print(f"warning: no run under {args.sweep} logged {', '.join(missing)}: those panels will be empty")
        if args.dry_run:
            out = args.out or (args.sweep or Path(".")) / f"wandb_{definition['kind']}.json"
            out.write_text(json.dumps(definition, indent=1))
            print(f"dry run: would create {text}\ndefinition: {out}")
        else:
            built.save()  # W&B prints the address
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, ImportError) as e:  # -o a folder
        ap.error(str(e))
    except wandb.errors.UsageError as e:  # not logged in
        ap.error(f"W&B: {e} (or set WANDB_API_KEY; --dry-run works offline)")
    except wandb.errors.Error as e:  # W&B unreachable, or refused
        ap.error(f"W&B: {e} (--dry-run works offline)")


def build(args):
    """(the W&B object, its JSON definition, its outline, panel keys no run logged)."""
    topk = parse_topk(args.topk)
    entity, project, group, runs = args.entity, args.project, args.group, []
    if args.sweep is not None:
        if not args.sweep.is_dir():
            raise FileNotFoundError(f"no such sweep directory: {args.sweep}")
        entity, project, group, runs = sweep_target(args.sweep, (entity, project, group))
    if not project:
        raise ValueError("give a sweep directory or --project (and --group)")
    if not args.dry_run and not entity:
        import wandb  # noqa: PLC0415

        entity = wandb.Api().default_entity
    if args.report:
        if args.group:
            raise ValueError("--report shows the groups conf/ gives its sweeps; --group is the workspace's")
        from .report import report, report_definition, report_outline, report_panels  # noqa: PLC0415

        built = report(entity or "", project, metric=args.metric, topk=topk, title=args.name)
        definition, text, named = report_definition(built), report_outline(built), panel_keys(report_panels(built))
    else:
        if not group:
            raise ValueError("give a sweep directory or --group")
        built = workspace(entity or "", project, group, args.metric, topk, args.name)
        definition, text, named = workspace_definition(built), outline(built, group), workspace_keys(built)
    return built, definition, text, missing_keys(named, keys_of(runs)) if runs else []


def parse_topk(text: str) -> tuple[int, ...]:
    """``--topk``'s value, ``1,5,50``: each k a whole number >= 1 (a top-0 error is no metric)."""
    try:
        topk = tuple(int(k) for k in text.split(","))
    except ValueError:
        topk = ()
    if not topk or min(topk) < 1:
        raise ValueError(f"--topk must be whole numbers >= 1 separated by commas (e.g. 1,5,50), not {text!r}")
    return topk


def keys_of(runs) -> dict[str, set[str]]:
    """What any of ``runs`` (wandb_files.WandbRun) logged, by section."""
    logged: dict[str, set[str]] = {"config": set(), "summary": set(), "history": set()}
    for r in runs:
        for section, keys in r.keys().items():
            logged[section] |= keys
    return logged


if __name__ == "__main__":
    main()
