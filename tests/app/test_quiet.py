"""What lst-train prints with its output redirected (nohup, a log file): progress lines
and where the results are, without other libraries' chatter."""
import os
import random
import subprocess
import sys

import pytest

from app_configs import FAST


# A whole CLI run on a fresh datasets cache (about a minute on a loaded 2-core machine): with
# -m slow, to keep the default suite within 15 min there; tests/app/callbacks/test_progress_log.py
# checks the progress lines in the fast suite.
@pytest.mark.slow
def test_redirected_output_shows_progress_and_no_chatter(tmp_path):
    rng = random.Random(0)
    words = sorted({"".join(rng.choices("abcdefghij", k=5)) for _ in range(1000)})  # ~1000 distinct words
    paragraphs = [" ".join(rng.choices(words, k=40)) for _ in range(400)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(paragraphs))
    run_dir = tmp_path / "run"
    env = {**os.environ, "LST_CACHE_DIR": str(tmp_path / "cache")}  # a fresh datasets cache: splits generated
    proc = subprocess.run([sys.executable, "-m", "lst_lightning.app.train", *FAST, "callbacks=default",
                           "data=text_files", f"data.path={tmp_path / 'corpus.txt'}", "callbacks.progress_every=5",
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for line in ("step 5/20", "step 20/20", "validation at step 20"):
        assert line in out, out[-3000:]
        assert line in (run_dir / "train.log").read_text()
    for noise in ("gensim", "Generating train split", "💡", "Tip:", "deprecated", "Deprecat", "FutureWarning"):
        assert noise not in out, (noise, out[-3000:])
    assert out.count("GPU available") == 1  # not once from Lightning's own handler and once from Hydra's
    assert f"Results: {run_dir.resolve() / 'results.json'}" in proc.stdout
    assert (run_dir / "results.json").is_file()


SHOW = """
import logging, sys
from lst_lightning.app.quiet import show_our_lines
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="root: %(message)s")
show_our_lines(sys.argv[2])
show_our_lines(sys.argv[2])  # idempotent: one line each, not two
logging.getLogger("lst_lightning.app.step_choice").info("head.step=auto: the choice")
logging.getLogger("lst_lightning.app.step_choice").debug("not shown")
logging.getLogger("other").info("not ours")
"""


@pytest.mark.parametrize("logging_configured", [False, True])
def test_our_info_lines_show_once_where_nothing_configured_logging(tmp_path, logging_configured):
    """``scripts/quality_table.py`` calls ``train.run`` without Hydra's logging: the step's
    choice and the progress still show, once, and go to the run's log file; where the caller
    configured logging (Hydra, the user), its handlers show them and nothing is added."""
    log_file = tmp_path / "train.log"
    proc = subprocess.run([sys.executable, "-c", SHOW, "configured" if logging_configured else "bare", str(log_file)],
                          capture_output=True, text=True, check=True)
    if logging_configured:
        assert proc.stderr.splitlines() == ["root: head.step=auto: the choice", "root: not ours"]
        assert not log_file.exists()
    else:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].endswith("[lst_lightning.app.step_choice][INFO] - head.step=auto: the choice")
        assert log_file.read_text().splitlines() == lines
