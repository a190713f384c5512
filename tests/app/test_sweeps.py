"""Sweeps and comparison reports: the sweep configs compose and name real keys, a 2x2
Hydra multirun makes four runs that lst-compare turns into a report, lst-compare's
reading of the CSV logs, and a three-trial Optuna search."""
import csv
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lst_lightning.app.compare import compare
from lst_lightning.app.configs import config_dir
from lst_lightning.app.dashboard import main as dashboard
from lst_lightning.app.sweep_group import sweep_group

from app_configs import lst_train

CONF = Path(config_dir())
# Seconds per job: tiny data, CSV only, no progress bar, few steps and eval examples.
FAST = ["experiment=tiny", "logger=csv", "callbacks=minimal", "trainer.limit_train_batches=10",
        "data.max_eval_examples=128"]


def has_optuna() -> bool:
    try:  # find_spec raises when the namespace package hydra_plugins is absent too
        return importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    except ModuleNotFoundError:
        return False


HAS_OPTUNA = has_optuna()


@pytest.mark.parametrize("sweep", sorted(p.stem for p in (CONF / "sweep").glob("*.yaml")))
def test_sweep_config_names_real_keys(sweep):
    """Every swept key exists in the composed config and every group value is a file."""
    if sweep.startswith("optuna") and not HAS_OPTUNA:
        pytest.skip("the optuna extra is not installed (uv sync --extra optuna)")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"+sweep={sweep}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params, f"{sweep} sweeps nothing"
    for key, values in params.items():
        if (CONF / key).is_dir():  # a config group: every choice must exist
            for v in str(values).split(","):
                assert (CONF / key / f"{v.strip()}.yaml").is_file(), f"{sweep}: {key}={v} has no config"
        else:
            absent = object()  # a key may be null (head.lr: the loss's default)
            assert OmegaConf.select(cfg, key, default=absent) is not absent, f"{sweep}: {key} is not a config key"
    assert cfg.logger.wandb.group, f"{sweep}: its W&B runs need a group"


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A 2x2 multirun over the Z-loss's a and b."""
    root = tmp_path_factory.mktemp("grid")
    lst_train("-m", *FAST, "loss=zloss", "loss.kwargs.a=0.1,1", "loss.kwargs.b=5,20", f"hydra.sweep.dir={root}",
              cwd=root)
    return root


def test_grid_multirun_makes_four_named_runs(grid):
    results = [json.loads(p.read_text()) for p in sorted(grid.glob("*/results.json"))]
    assert len(results) == 4
    names = {r["name"] for r in results}
    # each job's name says which point of the grid it is (one W&B run per job)
    assert names == {f"tiny[loss.kwargs.a={a},loss.kwargs.b={b}]" for a in ("0.1", "1") for b in ("5", "20")}
    for r in results:
        assert r["train_steps"] == 10 and 0.0 <= r["test"]["top5_error"] <= 1.0
    configs = [yaml.safe_load(p.read_text()) for p in sorted(grid.glob("*/config.yaml"))]
    assert {(c["loss"]["kwargs"]["a"], c["loss"]["kwargs"]["b"]) for c in configs} == {
        (0.1, 5), (0.1, 20), (1, 5), (1, 20)}


def test_compare_turns_the_grid_into_a_report(grid, tmp_path):
    out = tmp_path / "report"
    res = compare([grid], out, metric="test/top5_error")
    assert res["runs"] == 4
    for f in ("runs.csv", "runs.md", "heatmap.png", "curves_steps.png", "curves_time.png", "report.html"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert len(rows) == 4
    errors = [float(r["test/top5_error"]) for r in rows]
    assert errors == sorted(errors)  # sorted by the chosen metric
    by_dir = {r["dir"]: r for r in rows}
    for p in grid.glob("*/results.json"):
        want = json.loads(p.read_text())
        row = by_dir[str(p.parent)]
        assert float(row["test/mrr"]) == pytest.approx(want["test"]["mrr"])
        assert float(row["step_time_ms"]) == pytest.approx(want["step_time_ms"])
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert all(r["run"] in page for r in rows)
    assert len((out / "runs.md").read_text().strip().splitlines()) == 2 + 4


def test_the_grid_is_one_wandb_group_the_dashboard_finds(grid, tmp_path):
    """Started with -m and no group (the new user's way): every job names the sweep's
    group, and lst-dashboard reads it from the runs' config.yaml (not Hydra's .hydra copy)."""
    groups = {yaml.safe_load(p.read_text())["logger"]["wandb"]["group"] for p in grid.glob("*/config.yaml")}
    assert groups == {sweep_group(grid)}
    dashboard([str(grid), "--dry-run", "-o", str(tmp_path / "w.json")])
    assert json.loads((tmp_path / "w.json").read_text())["name"] == f"lst-lightning {sweep_group(grid)}"


# the sweeps of conf/sweep (a preset's grid narrowed on the command line; Optuna), fast_dev_run-sized
STARTS = {"preset": ["+sweep=zloss_ab", "loss.kwargs.a=0.1,1", "loss.kwargs.b=5"],
          "optuna": ["+sweep=optuna_zloss", "hydra.sweeper.n_trials=2"]}


@pytest.mark.slow  # two jobs in a subprocess each; the grid (-m with overrides) is in the fast suite
@pytest.mark.parametrize("start", sorted(STARTS))
def test_compare_and_dashboard_read_a_multirun_however_it_was_started(tmp_path, start):
    if start == "optuna" and not HAS_OPTUNA:
        pytest.skip("the optuna extra is not installed (uv sync --extra optuna)")
    sweep = tmp_path / "sweep"
    lst_train("-m", *STARTS[start], "experiment=tiny", "+trainer.fast_dev_run=true", f"hydra.sweep.dir={sweep}",
              cwd=tmp_path)
    assert len(list(sweep.glob("*/results.json"))) == 2
    group = f"sweep-{start}_zloss" if start == "optuna" else "sweep-zloss_ab"  # the preset's own group
    assert {yaml.safe_load(p.read_text())["logger"]["wandb"]["group"] for p in sweep.glob("*/config.yaml")} == {group}
    assert compare([sweep], tmp_path / "report")["runs"] == 2
    assert (tmp_path / "report" / "report.html").is_file()
    dashboard([str(sweep), "--dry-run"])
    assert json.loads((sweep / "wandb_workspace.json").read_text())["name"] == f"lst-lightning {group}"


@pytest.mark.slow  # three trials in a subprocess; the grid multirun covers sweeps in the fast suite
@pytest.mark.skipif(not HAS_OPTUNA, reason="the optuna extra is not installed (uv sync --extra optuna)")
def test_optuna_search_of_three_trials(tmp_path):
    lst_train("-m", "+sweep=optuna_zloss", *FAST, "hydra.sweeper.n_trials=3",
              f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    results = [json.loads(p.read_text()) for p in tmp_path.glob("*/results.json")]
    assert len(results) == 3
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    # the search minimised the configured objective (val/top5_error) over its trials
    assert best["best_value"] == pytest.approx(min(r["val"]["top5_error"] for r in results))
    assert set(best["best_params"]) == {"loss.kwargs.a", "loss.kwargs.b", "head.lr"}
