"""lst-dashboard (dashboard.py, wandb_panels.py): the sweep's workspace, defined with
wandb-workspaces, written offline as the spec W&B would receive; every key a panel
names is one the runs logged (read from W&B's own files); clear errors."""
import json
import sys

import pytest

from lst_lightning.app import wandb_panels
from lst_lightning.app.dashboard import SECTIONS, keys_of, main, panels_of, workspace, workspace_keys
from lst_lightning.app.wandb_files import read_runs
from lst_lightning.app.wandb_panels import TIME, missing_keys, named_keys

ws = pytest.importorskip("wandb_workspaces.workspaces")


def test_every_panel_names_a_key_the_runs_logged(wandb_sweep, wandb_group):
    logged = keys_of(read_runs(wandb_sweep))
    w = workspace("me", "lst-lightning", wandb_group)
    named = set(workspace_keys(w))
    assert {("config", "a"), ("config", "head_loss"), ("summary", "test/top50_error"), ("history", TIME),
            ("history", "head/folds"), ("summary", "step_time_ms"), ("config", "D"), ("summary", "wall_s")} <= named
    assert missing_keys(workspace_keys(w), logged) == []
    # the check can fail: a metric no run logged, a top-k error not in the runs' metrics.topk
    assert missing_keys(workspace_keys(workspace("me", "p", "g", metric="test/top3_error")), logged) == [
        "summary:test/top3_error"]
    assert missing_keys(workspace_keys(workspace("me", "p", "g", topk=(1, 2))), logged) == [
        "summary:test/top2_error", "history:val/top2_error"]


def test_the_time_axis_has_every_validation_point(wandb_sweep):
    for run in read_runs(wandb_sweep):
        val_rows = [row for row in run.history if "val/top5_error" in row]
        assert val_rows and all(TIME in row for row in val_rows)


def test_dry_run_writes_the_spec_beside_the_sweep(wandb_sweep, wandb_group, capsys):
    """A sweep started with -m and no group: its jobs share one group, the dashboard finds it."""
    main([str(wandb_sweep), "--dry-run"])
    out = capsys.readouterr().out
    assert "warning" not in out and all(s in out for s in SECTIONS)
    d = json.loads((wandb_sweep / "wandb_workspace.json").read_text())
    assert (d["kind"], d["project"], d["name"]) == ("workspace", "lst-lightning", f"lst-lightning {wandb_group}")
    # W&B's own library reads the spec back into the same workspace
    from wandb_workspaces.workspaces import internal

    view = internal.View(entity=d["entity"], project=d["project"], display_name=d["name"], name="", id="",
                         spec=internal.WorkspaceViewspec.model_validate(d["spec"]))
    back = ws.Workspace._from_model(view)
    assert [s.name for s in back.sections] == list(SECTIONS)
    assert back.runset_settings.filters == f"Metric(\"Group\") == '{wandb_group}'"
    built = workspace("", "lst-lightning", wandb_group)
    assert [named_keys(p) for p in panels_of(back)] == [named_keys(p) for p in panels_of(built)]
    assert workspace_keys(back) == workspace_keys(built)  # the runs table's columns too
    assert back.auto_generate_panels is False  # only these panels, not every key in alphabetical order


def test_a_panel_key_no_run_logged_is_reported(wandb_sweep, tmp_path, capsys):
    main([str(wandb_sweep), "--dry-run", "--metric", "test/top3_error", "-o", str(tmp_path / "w.json")])
    out = capsys.readouterr().out
    assert "warning: no run under" in out and "summary:test/top3_error" in out
    assert (tmp_path / "w.json").is_file()


def test_bad_input(tmp_path, capsys):
    for argv, message in [([str(tmp_path / "missing"), "--dry-run"], "no such sweep directory"),
                          ([str(tmp_path), "--dry-run"], "holds no W&B offline run"),
                          (["--dry-run", "--group", "g"], "give a sweep directory or --project"),
                          (["--dry-run", "--project", "p"], "give a sweep directory or --group"),
                          (["--report", "--dry-run", "--project", "p", "--group", "g"], "--group is the workspace's"),
                          (["--dry-run", "--project", "p", "--group", "g", "--topk", "1,x"],
                           "--topk must be whole numbers >= 1 separated by commas (e.g. 1,5,50), not '1,x'"),
                          (["--dry-run", "--project", "p", "--group", "g", "--topk", "0,5"], "not '0,5'")]:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
    for job, group in (("0", "g1"), ("1", "g2")):  # runs of two groups: which one?
        (tmp_path / job).mkdir()
        (tmp_path / job / "config.yaml").write_text(f"logger:\n  wandb:\n    project: p\n    group: {group}\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dry-run"])
    assert "several W&B places: give --group (they have ['g1', 'g2'])" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_runs_of_several_groups_take_the_group_given(tmp_path, capsys):
    """The refusal of a directory whose runs go to several groups says to give --group: given, it stands
    (it was refused all the same)."""
    for job, group in (("0", "g1"), ("1", "g2")):
        (tmp_path / job).mkdir()
        (tmp_path / job / "config.yaml").write_text(f"logger:\n  wandb:\n    project: p\n    group: {group}\n")
    main([str(tmp_path), "--dry-run", "--group", "g2"])
    assert "runs of group 'g2'" in capsys.readouterr().out
    d = json.loads((tmp_path / "wandb_workspace.json").read_text())
    assert (d["project"], d["name"]) == ("p", "lst-lightning g2")


@pytest.mark.parametrize("flag,value,have", [("--group", "g3", "['g1', 'g2']"), ("--project", "q", "['p']")])
def test_a_group_or_project_no_run_goes_to_is_refused(tmp_path, capsys, flag, value, have):
    """A --group (--project) that matches no run of the sweep: one line naming those its runs have,
    nothing written (it wrote a workspace of no run)."""
    for job, group in (("0", "g1"), ("1", "g2")):
        (tmp_path / job).mkdir()
        (tmp_path / job / "config.yaml").write_text(f"logger:\n  wandb:\n    project: p\n    group: {group}\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dry-run", "--group", "g1", flag, value])
    assert f"no run under {tmp_path} goes to {flag} {value}: they have {have}" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_a_config_that_does_not_parse_is_named(tmp_path, capsys):
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "config.yaml").write_text("logger: [\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dry-run"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"lst-dashboard: error: {tmp_path / '0' / 'config.yaml'} does not parse")


def test_an_out_that_is_a_folder_or_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "config.yaml").write_text("logger:\n  wandb:\n    project: p\n    group: g\n")
    (tmp_path / "afile").write_text("")
    for out, match in ((tmp_path / "0", "Is a directory"), (tmp_path / "afile" / "w.json", "Not a directory")):
        with pytest.raises(SystemExit):
            main([str(tmp_path), "--dry-run", "-o", str(out)])
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and match in err[0] and str(out) in err[0], err  # a traceback


def test_without_wandb_workspaces_it_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)
    monkeypatch.setitem(sys.modules, "wandb_workspaces.workspaces", None)
    with pytest.raises(ImportError, match="uv sync --extra dashboard"):
        wandb_panels.libraries()
    with pytest.raises(SystemExit):
        main(["--project", "p", "--group", "g", "--dry-run"])
    assert "wandb-workspaces" in capsys.readouterr().err


def test_online_without_a_login_is_one_clear_line(monkeypatch, tmp_path, capsys):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["--entity", "me", "--project", "p", "--group", "g"])
    err = capsys.readouterr().err
    assert "wandb login" in err and "--dry-run works offline" in err and "Traceback" not in err
