"""The W&B report template (report.py): three comparisons over the W&B groups the configs
log to, written offline as the spec W&B would receive and read back by W&B's library;
every key a panel names is one the runs logged."""
import json

import pytest

from lst_lightning.app.dashboard import keys_of, main
from lst_lightning.app.report import default_groups, report, report_panels
from lst_lightning.app.wandb_files import read_runs
from lst_lightning.app.wandb_panels import STEP, TIME, missing_keys, named_keys, panel_keys

from app_configs import cfg_of

wr = pytest.importorskip("wandb_workspaces.reports.v2")


def test_groups_are_those_the_sweeps_log_to():
    groups = default_groups()
    assert groups["ab"] == [cfg_of("+sweep=zloss_ab").logger.wandb.group]
    assert groups["vs_softmax"] == [cfg_of("+sweep=vs_softmax").logger.wandb.group,
                                    cfg_of("+sweep=heads").logger.wandb.group]
    assert groups["factored_vs_naive"] == [cfg_of("experiment=factored_vs_naive").logger.wandb.group]


def test_every_panel_names_a_key_the_runs_logged(wandb_sweep):
    panels = report_panels(report("me", "lst-lightning"))
    assert missing_keys(panel_keys(panels), keys_of(read_runs(wandb_sweep))) == []
    xs = {p.x for p in panels if isinstance(p, wr.LinePlot)}
    assert xs == {STEP, TIME}  # steps (factored vs naive, a/b) and wall-clock (vs softmax)


def test_dry_run_is_the_spec_w_and_b_reads_back(tmp_path, capsys):
    out = tmp_path / "report.json"
    main(["--report", "--project", "lst-lightning", "--dry-run", "-o", str(out)])
    printed = capsys.readouterr().out
    assert "Factored vs naive" in printed and "a/b study" in printed
    d = json.loads(out.read_text())
    assert (d["kind"], d["project"]) == ("report", "lst-lightning")
    from wandb_workspaces.reports.v2 import internal

    back = wr.Report._from_model(internal.ReportViewspec(
        display_name=d["title"], description=d["description"],
        project=internal.Project(name=d["project"], entity_name=d["entity"]), spec=internal.Spec.model_validate(d["spec"])))
    grids = [b for b in back.blocks if isinstance(b, wr.PanelGrid)]
    assert [[rs.filters for rs in g.runsets] for g in grids] == [
        ["Metric(\"Group\") == 'factored_vs_naive'"], ["Metric(\"Group\") in ['sweep-vs_softmax', 'sweep-heads']"],
        ["Metric(\"Group\") == 'sweep-zloss_ab'"]]
    built = report("", "lst-lightning")
    assert [named_keys(p) for g in grids for p in g.panels] == [named_keys(p) for p in report_panels(built)]
    # the runsets read the report's own project: nothing looked up online
    assert all(not rs.project and not rs.entity for g in grids for rs in g.runsets)
