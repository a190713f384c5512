"""ProgressLog: a line every few steps (step, loss, tokens/s, ETA) and one per validation."""
import logging
import re

import pytest

from lst_lightning.app.callbacks import ProgressLog
from lst_lightning.app.callbacks.progress_log import clock
from lst_lightning.app.train import run

from app_configs import FAST, cfg_of


def test_a_line_every_n_steps_and_one_per_validation(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lst_lightning.progress")
    run(cfg_of(*FAST, "head=softmax", "callbacks.progress_every=5", "trainer.val_check_interval=10",
               "data.max_eval_examples=64", "metrics.timing_every=0"), tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "lst_lightning.progress"]
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [int(re.match(r"step (\d+)/20 ", ln).group(1)) for ln in steps] == [5, 10, 15, 20], lines
    for ln in steps:
        assert re.search(r"loss \d", ln) and re.search(r"\d+ tokens/s", ln) and re.search(r"ETA \d+:\d\d$", ln), ln
    assert steps[-1].endswith("ETA 0:00")
    vals = [ln for ln in lines if ln.startswith("validation")]
    assert [ln.split(":")[0] for ln in vals] == ["validation at step 10", "validation at step 20"], lines
    assert all("top5_error" in ln and "mrr" in ln for ln in vals)


def test_clock():
    assert (clock(0), clock(61.4), clock(3723)) == ("0:00", "1:01", "1:02:03")


@pytest.mark.parametrize("every", [-1, 2.5])
def test_bad_interval_is_refused(every):
    with pytest.raises(ValueError, match="progress_every"):
        ProgressLog(every=every)
