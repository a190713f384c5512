"""A small sweep logged to W&B offline (and to the CSV log), made once per test run (made_once.py): the
W&B reader, lst-compare, the dashboards and the run record are tested on what W&B wrote."""
import pytest

from lst_lightning.app.sweep_group import sweep_group

from app_configs import lst_train
from made_once import made_once


@pytest.fixture(scope="session")
def wandb_sweep(tmp_path_factory):
    """Two jobs of a multirun over the Z-loss's a (loss=zloss: the default is loss=sampled),
    each its own W&B offline run: 10 steps, validation every 5, tiny data, the head's flags read
    every 4 steps (its logged counters are those reads'). Started as a new
    user would, with ``-m`` and no group given: the jobs share the sweep's group (``wandb_group``)."""
    return made_once(tmp_path_factory, "wandb_sweep", run_sweep)


def run_sweep(root) -> None:
    lst_train("-m", "experiment=tiny", "callbacks=minimal", "trainer.limit_train_batches=10",
              "trainer.val_check_interval=5", "data.max_eval_examples=128", "loss=zloss", "loss.kwargs.a=0.1,1", "head.sync_every=4",
              f"hydra.sweep.dir={root}", cwd=root)


@pytest.fixture(scope="session")
def wandb_group(wandb_sweep):
    """The W&B group of ``wandb_sweep``'s jobs: named after its directory."""
    return sweep_group(wandb_sweep)
