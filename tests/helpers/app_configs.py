"""Composing the app's Hydra config in tests, its fast settings, and lst-train in a subprocess."""
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from lst_lightning.app.configs import config_dir

CONF = Path(config_dir())
TOY = "toy_heads.ToySelfUpdatingHead"
TOY_SOFTMAX = "toy_heads.ToySoftmaxHead"
# Tiny and quiet: no W&B, no progress bar.
FAST = ["experiment=tiny", "logger=csv", "callbacks=minimal"]


def cfg_of(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_of(overrides: list, run_dir, **kwargs) -> dict:
    """lst-train's ``run`` on ``cfg_of(*overrides)``: what a fresh process is handed (forked_ranks.py's
    ``in_fresh_process``: the overrides pickle, the composed config's classes do not)."""
    from lst_lightning.app.train import run  # noqa: PLC0415

    return run(cfg_of(*overrides), run_dir, **kwargs)


def cfgs_of(*override_lists):
    """Several configs composed under one Hydra initialisation."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return [compose("config", overrides=list(o)) for o in override_lists]


def group(name):
    return sorted(p.stem for p in (CONF / name).glob("*.yaml"))


def lst_train(*args, cwd):
    """``lst-train ARGS`` in a fresh process (a Hydra multirun needs one), which must succeed."""
    proc = subprocess.run([sys.executable, "-m", "lst_lightning.app.train", *args], cwd=cwd,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
