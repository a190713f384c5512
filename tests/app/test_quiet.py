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
