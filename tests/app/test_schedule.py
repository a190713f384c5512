"""The lr schedule: its shape over the steps, and its decay over the training budget,
whichever of the steps and the time (trainer.max_time) runs out first."""
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Timer

from lst_lightning.app.module import LanguageModel, time_spent
from lst_lightning.app.schedule import lr_factor
from lst_lightning.heads import SoftmaxHead
from lst_lightning.models import NgramMLP

COSINE = {"name": "cosine", "warmup_steps": 10, "min_factor": 0.1}


def test_the_steps_shape():
    assert lr_factor(0, total_steps=110, **COSINE) == pytest.approx(0.1)  # warm-up
    assert lr_factor(10, total_steps=110, **COSINE) == pytest.approx(1.0)
    assert lr_factor(60, total_steps=110, **COSINE) == pytest.approx(0.55)
    assert lr_factor(110, total_steps=110, **COSINE) == pytest.approx(0.1)
    assert lr_factor(500, total_steps=110, **{**COSINE, "name": "linear"}) == pytest.approx(0.1)
    assert lr_factor(60, total_steps=110, **{**COSINE, "name": "constant"}, time_spent=0.9) == 1.0
    assert lr_factor(60, total_steps=float("inf"), **COSINE) == 1.0  # no step limit, no time limit


def test_over_the_budget_the_decay_follows_whichever_runs_out_first():
    ahead_in_time = lr_factor(35, total_steps=110, **COSINE, time_spent=0.5)
    assert ahead_in_time == pytest.approx(0.55)  # half the time spent, a quarter of the steps
    assert lr_factor(85, total_steps=110, **COSINE, time_spent=0.5) == pytest.approx(lr_factor(85, total_steps=110,
                                                                                                 **COSINE))
    assert lr_factor(35, total_steps=float("inf"), **COSINE, time_spent=1.0) == pytest.approx(0.1)
    steps_only = lr_factor(35, total_steps=110, **COSINE, over="steps", time_spent=0.5)
    assert steps_only == pytest.approx(lr_factor(35, total_steps=110, **COSINE)) and steps_only > 0.8
    assert lr_factor(5, total_steps=110, **COSINE, time_spent=0.99) == pytest.approx(0.6)  # warm-up first


@pytest.mark.parametrize("bad, match", [({"name": "step"}, "scheduler.name"), ({"over": "time"}, "scheduler.over")])
def test_bad_settings_are_refused_in_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        lr_factor(0, total_steps=10, **{**COSINE, **bad})
    assert "\n" not in str(e.value)


def test_time_spent_reads_lightnings_timer_and_its_restored_time():
    assert time_spent(None) == 0.0
    assert time_spent(Timer()) == 0.0  # a timer without a duration sets no budget
    timer = Timer(duration=timedelta(seconds=200))
    timer.load_state_dict({"time_elapsed": {"train": 50.0}})  # a resumed run's elapsed time
    assert time_spent(timer) == pytest.approx(0.25)


class Clock(Timer):
    """A caller's own Timer beside Lightning's, no budget (quality_table.py's ValidationCurve)."""

    @property
    def state_key(self):
        return "Clock"


@pytest.mark.parametrize("over", ["budget", "steps"])
def test_a_run_with_a_time_budget_decays_over_it(tmp_path, over):
    """Lightning's Timer (trainer.max_time) drives the schedule: 90 % of a day's budget spent
    (restored as on resume), 1 of 4 steps taken: over the budget the lr is near its floor,
    over the steps it has barely decayed. A Timer without a budget ahead of it is passed over."""
    torch.manual_seed(0)
    body = NgramMLP(30, 2, embed_dim=4, hidden_sizes=[8], hidden_dim=6)
    model = LanguageModel(body, SoftmaxHead(num_classes=30, hidden_dim=6),
                          optimizer={"name": "sgd", "lr": 0.1}, scheduler={**COSINE, "warmup_steps": 0, "over": over},
                          topk=(1,))
    timer = Timer(duration=timedelta(days=1))
    timer.load_state_dict({"time_elapsed": {"train": 0.9 * 86400}})
    data = [(torch.randint(0, 30, (8, 2)), torch.randint(0, 30, (8,))) for _ in range(4)]
    trainer = pl.Trainer(max_steps=4, callbacks=[Clock(), timer], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    factor = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0](1)
    if over == "budget":
        assert factor < 0.13  # cosine at 90 % of the time: 0.122
    else:
        assert factor == pytest.approx(lr_factor(1, total_steps=4, **{**COSINE, "warmup_steps": 0}))
