"""lst-train's route reads the host at most once in ten optimizer steps: the factored head's
device flags every 64 steps, the repairs then due, the head's stats and the progress line when
logged. Counted (tests/helpers/host_reads.py) from the third optimizer step to the last, on one
device, with and without gradient accumulation (the read at the end of training, once a run,
after that)."""
import lightning.pytorch as pl
import pytest

from lst_lightning.app.train import build

from app_configs import FAST, cfg_of
from host_reads import HostReads

STEPS = 130


class CountFrom(pl.Callback):
    """HostReads from optimizer step 2 to the end of the last one."""

    def __init__(self):
        self.reads = HostReads()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2 and batch_idx % trainer.accumulate_grad_batches == 0:
            self.reads.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == STEPS and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.reads.__exit__(None, None, None)


# accumulate=2 with -m slow: the head's accumulated route counts its reads in tests/spherical/test_host_reads.py
@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_lst_train_reads_the_host_at_most_once_in_ten_steps(tmp_path, accumulate):
    cfg = cfg_of(*FAST, "head=factored", "test=false", "trainer.limit_val_batches=0",
                 f"trainer.limit_train_batches={STEPS * accumulate}", f"trainer.accumulate_grad_batches={accumulate}",
                 "trainer.log_every_n_steps=50")
    dm, module, trainer = build(cfg, tmp_path)
    count = CountFrom()
    trainer.callbacks.append(count)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == STEPS and int(module.head.steps) == STEPS
    assert count.reads.count / (STEPS - 2) <= 0.1, count.reads.sites
    assert count.reads.count >= 1  # the flags are read (at step 64, 128)


class LoggedStats(pl.Callback):
    """The head's stats as the flags' last read took them by the end of each step (lst-train's
    fused step on the CPU reads them in the forward, before the step logs), and what it logged."""

    def __init__(self):
        self.pairs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = {k[len("head/"):]: float(v) for k, v in trainer.callback_metrics.items()
                  if k.startswith("head/") and k != "head/lr"}
        self.pairs.append((dict(pl_module.head.step_checks.stats), logged))


def test_the_head_stats_logged_every_step_read_nothing_more(tmp_path):
    """Logged every step, the head's stats are the values the device flags' own read took (every
    64 steps, in the same transfer): the route still reads the host at most once in ten steps."""
    cfg = cfg_of(*FAST, "head=factored", "test=false", "trainer.limit_val_batches=0",
                 f"trainer.limit_train_batches={STEPS}", "trainer.log_every_n_steps=1")
    dm, module, trainer = build(cfg, tmp_path)
    count, logged = CountFrom(), LoggedStats()
    trainer.callbacks.extend([count, logged])
    trainer.fit(module, datamodule=dm)
    assert count.reads.count / (STEPS - 2) <= 0.1, count.reads.sites
    assert module.head.step == "fused"
    read = [(taken, got) for taken, got in logged.pairs if taken]
    assert len(read) == STEPS - 63  # logged from the first read on (step 64)
    assert all(got == pytest.approx(taken, rel=1e-6) for taken, got in read), read[:2]  # (logged in float32)
    assert read[-1][1]["steps"] == 128
