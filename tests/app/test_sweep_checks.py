"""Every job of a multirun checked before the first starts: the jobs listed as the sweeper
lists them, each composed and checked in-process; a refusal names the job and its overrides."""
import subprocess
import sys

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import open_dict, read_write

from lst_lightning.app.sweep_checks import Refused, check_every_job, refusals

from app_configs import CONF


def check_sweep(*overrides, params=None):
    """``check_every_job`` on the multirun config of ``lst-train -m OVERRIDES`` (and
    ``hydra.sweeper.params``: ``params``), under the Hydra the app has while it runs."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = GlobalHydra.instance().hydra.compose_config("config", list(overrides), run_mode=RunMode.MULTIRUN,
                                                          with_log_configuration=False)
        if params is not None:
            with read_write(cfg), open_dict(cfg):
                cfg.hydra.sweeper.params = params
        check_every_job(cfg)


def test_a_later_jobs_bad_value_is_refused_naming_the_job():
    with pytest.raises(ValueError, match=r"^job #1 of 2 \(experiment=tiny trainer.max_steps=-5\): "
                                         r"trainer.max_steps=-5: must be a whole number >= 0"):
        check_sweep("experiment=tiny", "trainer.max_steps=5,-5")


def test_a_later_jobs_bad_head_setting_is_refused():
    """``head.lr=1,-1``: the head's own check of its lr (checks.check_head_settings), before job #0 trains."""
    with pytest.raises(ValueError, match=r"^job #1 of 2 \(experiment=tiny head.lr=-1\): head.lr=-1: lr must be finite"):
        check_sweep("experiment=tiny", "head.lr=1,-1")


def test_a_good_sweep_passes():
    check_sweep("experiment=tiny", "loss=zloss", "loss.kwargs.a=0.1,1")


def test_the_sweepers_params_are_jobs_too():
    """A preset's ``hydra.sweeper.params`` (``+sweep=...``), with the command line's overrides."""
    with pytest.raises(ValueError, match=r"^job #2 of 4 \(seed=-1 experiment=tiny cpu_threads=1\): seed=-1: must"):
        check_sweep("experiment=tiny", "cpu_threads=1,2", params={"seed": "0,-1"})


def test_a_jobs_overrides_are_checked_before_it_composes():
    """``loss=zloss`` with ``head.negatives.*``: the one line of check_overrides, not Hydra's assertion."""
    with pytest.raises(ValueError, match=r"^job #1 of 2 \(experiment=tiny loss=zloss head.negatives.num=3\): "
                                         r"head.negatives.num=3: head.negatives are the sampled classes"):
        check_sweep("experiment=tiny", "loss=sampled,zloss", "head.negatives.num=3")


def test_a_jobs_head_composes_on_the_apps_hydra():
    """``head.lr`` with a head=factored,softmax sweep: each job's head composed inside the running
    Hydra (no second initialisation): the softmax job's line."""
    with pytest.raises(ValueError, match=r"^job #1 of 2 \(experiment=tiny head=softmax head.lr=1\): head.lr=1: "
                                         "head.lr is a self-updating head's own SGD lr"):
        check_sweep("experiment=tiny", "head=factored,softmax", "head.lr=1")


def test_a_jobs_config_reads_its_own_hydra_node():
    check_sweep("experiment=tiny", "name=${hydra:runtime.choices.head}", "head=factored,naive")


def test_an_optuna_searchs_ends_and_choices_are_checked():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the optuna extra (uv sync --extra optuna)")
    with pytest.raises(ValueError, match=r"^a trial \(experiment=tiny optimizer.lr=-0.1 seed=0\): optimizer.lr=-0.1: "):
        check_sweep("hydra/sweeper=optuna", "experiment=tiny", "optimizer.lr=interval(-0.1, 0.1)", "seed=choice(0,1)")
    with pytest.raises(ValueError, match=r"^a trial \(experiment=tiny seed=-1\): seed=-1: must"):
        check_sweep("hydra/sweeper=optuna", "experiment=tiny", "seed=choice(0,-1)")
    check_sweep("hydra/sweeper=optuna", "experiment=tiny", "optimizer.lr=tag(log, interval(0.001, 0.1))")


def test_a_refusal_passes_hydras_callbacks_and_is_raised_again_as_itself():
    """Hydra's callbacks turn an Exception into a warning: the refusal passes them as ``Refused``,
    and ``refusals()`` (around the app in ``main``) raises the error itself."""
    from hydra._internal.callbacks import Callbacks  # noqa: PLC0415  (what Hydra calls the config's callbacks with)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = GlobalHydra.instance().hydra.compose_config("config", ["experiment=tiny", "seed=0,-1"],
                                                          run_mode=RunMode.MULTIRUN, with_log_configuration=False)
        with pytest.raises(Refused):
            Callbacks(cfg).on_multirun_start(config=cfg)
        with pytest.raises(ValueError, match=r"^job #1 of 2 \(experiment=tiny seed=-1\): seed=-1: must"), refusals():
            Callbacks(cfg).on_multirun_start(config=cfg)


def test_lst_train_refuses_a_sweep_before_its_first_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "lst_lightning.app.train", "-m", "experiment=tiny", "logger=csv",
                           "trainer.max_steps=5,-5", f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "lst-train: error: job #1 of 2 (experiment=tiny logger=csv trainer.max_steps=-5): trainer.max_steps=-5: "
        "must be a whole number >= 0, or -1 for no limit")
    assert not sweep.exists()  # job #0 never started
