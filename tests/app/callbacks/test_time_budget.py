"""app/callbacks/time_budget.py: trainer.max_time counts training time only, bounds the run
whatever the preset's epochs, survives a checkpoint, and shows in the progress bar."""
from __future__ import annotations

import time
import types

import pytest

from lst_lightning.app.callbacks import ProgressBar, TrainingClock, budget_timer
from lst_lightning.app.callbacks.time_budget import training_clock
from lst_lightning.app.train import time_bounded


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def trainer(**kw):
    state = types.SimpleNamespace(fn="fit")
    return types.SimpleNamespace(**{"state": state, "sanity_checking": False, "callbacks": [], **kw})


def test_validation_is_left_out_of_the_training_time_and_a_checkpoint_keeps_it(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    timer, t = TrainingClock("00:00:00:10"), trainer()
    timer.on_train_start(t, None)
    clock.now += 3
    timer.on_validation_start(t, None)
    clock.now += 50  # a slow validation
    timer.on_validation_end(t, None)
    clock.now += 2
    assert timer.time_elapsed() == pytest.approx(5) and timer.time_remaining() == pytest.approx(5)
    resumed = TrainingClock("00:00:00:10")
    resumed.load_state_dict(timer.state_dict())
    assert resumed.time_elapsed() == pytest.approx(5)


def test_a_time_budget_lifts_the_presets_epochs_and_replaces_lightnings_timer():
    kwargs = {"max_epochs": 2, "limit_train_batches": 2000, "max_steps": -1, "max_time": "00:00:02:00"}
    (clock,) = time_bounded(kwargs)
    assert isinstance(clock, TrainingClock) and clock.time_remaining() == 120
    assert "max_time" not in kwargs and kwargs["max_epochs"] == -1 and kwargs["limit_train_batches"] == 2000
    plain = {"max_epochs": 2}
    assert time_bounded(plain) == [] and plain == {"max_epochs": 2}
    (counting,) = time_bounded(plain, "cpu")  # no budget: the CPU clock still moves a time-based validation
    assert counting.clock == "cpu" and counting.time_remaining() is None and plain == {"max_epochs": 2}
    assert training_clock(trainer(callbacks=[counting])) is counting  # train/clock_s's, without a budget
    assert training_clock(trainer(callbacks=[counting, clock])) is clock and training_clock(trainer()) is None
    assert budget_timer(trainer(callbacks=[TrainingClock(None), clock])) is clock


def test_the_bar_shows_no_epoch_cap_where_there_is_none_and_the_time_left():
    bar = ProgressBar()
    bar._trainer = trainer(max_epochs=-1)
    assert bar._get_train_description(3).strip() == "Epoch 3"
    bar._trainer = trainer(max_epochs=5)
    assert bar._get_train_description(3).strip() == "Epoch 3/4"


def test_the_cpu_clock_counts_this_process_cpu_time_and_moves_a_time_based_validation(monkeypatch):
    """clock="cpu": the budget and a time-based val_check_interval count time.process_time, so a
    run trains as much work whatever else shares the machine; validation stays left out."""
    wall, cpu = Clock(), Clock()
    monkeypatch.setattr(time, "perf_counter", wall)
    monkeypatch.setattr(time, "process_time", cpu)
    monkeypatch.setattr(time, "monotonic", wall)
    timer, t = TrainingClock("00:00:00:10", clock="cpu"), trainer(
        _val_check_time_interval=4.0, _last_val_time=0.0, should_stop=False,
        strategy=types.SimpleNamespace(broadcast=lambda x: x))
    timer.on_train_start(t, None)
    wall.now += 30  # the machine is busy: a third of a core
    cpu.now += 3
    timer.on_train_batch_end(t, None, None, None, 0)
    assert timer.time_elapsed() == pytest.approx(3) and timer.time_remaining() == pytest.approx(7)
    assert wall.now - t._last_val_time == pytest.approx(3)  # 3 s of the 4 s interval on the CPU clock
    timer.on_validation_start(t, None)
    cpu.now += 20  # validation's CPU time is left out
    timer.on_validation_end(t, None)
    cpu.now += 1
    timer.on_train_batch_end(t, None, None, None, 1)
    assert timer.time_elapsed() == pytest.approx(4) and wall.now - t._last_val_time == pytest.approx(1)
    with pytest.raises(ValueError, match="clock='gpu'"):
        TrainingClock("00:00:00:10", clock="gpu")
