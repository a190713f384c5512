"""The W&B group of a multirun's jobs (app/sweep_group.py): named after the sweep
directory, a group given in the config kept, single runs untouched. The multiruns
themselves (their jobs share the group; lst-dashboard finds it) are in test_sweeps.py
and the ``wandb_sweep`` fixture's tests."""
from omegaconf import OmegaConf

from lst_lightning.app.sweep_group import group_the_sweep, sweep_group

from app_configs import FAST, cfg_of


def test_the_group_is_named_after_the_sweep_directory(tmp_path):
    assert sweep_group("multirun/2026-11-23/21-40-00") == "multirun/2026-11-23/21-40-00"
    assert sweep_group("/data/runs/multirun/zloss_ab/2026-11-23_21-40-00") == "multirun/zloss_ab/2026-11-23_21-40-00"
    long = tmp_path / ("x" * 200) / "2026-11-23_21-40-00"
    assert len(sweep_group(long)) == 128 and sweep_group(long).endswith("x/2026-11-23_21-40-00")


def test_a_multirun_job_gets_the_sweeps_group_unless_one_is_given():
    cfg = cfg_of(*FAST)
    assert cfg.logger.wandb.group is None
    group_the_sweep(cfg, None)  # a single run: its run name stays the default
    assert cfg.logger.wandb.group is None
    group_the_sweep(cfg, "multirun/2026-11-23/21-40-00")
    assert cfg.logger.wandb.group == "multirun/2026-11-23/21-40-00"
    given = cfg_of(*FAST, "logger.wandb.group=mine")
    group_the_sweep(given, "multirun/2026-11-23/21-40-00")
    assert given.logger.wandb.group == "mine"
    preset = cfg_of(*FAST, "+sweep=zloss_ab")
    group_the_sweep(preset, "multirun/zloss_ab/2026-11-23_21-40-00")
    assert preset.logger.wandb.group == "sweep-zloss_ab"


def test_a_config_without_wandb_settings_is_left_alone():
    cfg = OmegaConf.create({"logger": {"csv": True}})
    group_the_sweep(cfg, "multirun/a/b")
    assert cfg == OmegaConf.create({"logger": {"csv": True}})
