"""W&B's offline run files read with W&B's own reader (wandb_files.py): the same numbers
as the run's own CSV log and results.json, the CLI route equal to the direct one, and a
clear error for a file W&B cannot read."""
import csv
import json

import pytest

from lst_lightning.app import wandb_files
from lst_lightning.app.wandb_files import find_run_files, read_run


def test_reads_what_the_run_logged(wandb_sweep):
    files = find_run_files(wandb_sweep)
    assert len(files) == 2  # once each, though wandb/latest-run links to the run too
    for f in files:
        run = read_run(f)
        results = json.loads((run.run_dir / "results.json").read_text())
        assert run.name == results["name"] and run.project == "lst-lightning"
        assert run.summary["test/mrr"] == pytest.approx(results["test"]["mrr"])
        rows = list(csv.DictReader((run.run_dir / "csv" / "metrics.csv").open()))
        csv_val = [(float(r["step"]), float(r["val/top5_error"])) for r in rows if r.get("val/top5_error")]
        wb_val = [(h["trainer/global_step"], h["val/top5_error"]) for h in run.history if "val/top5_error" in h]
        assert wb_val == csv_val and len(wb_val) == 2  # validation every 5 of 10 steps (float32 in both)
        assert run.config["loss.kwargs.a"] in (0.1, 1) and run.tags == ["FactoredSphericalHead", "zloss"]
        assert read_run(f.parent).summary == run.summary  # the W&B run directory names the same run


def test_without_the_cli_helpers_the_cli_reads_the_same(wandb_sweep, monkeypatch):
    from wandb.cli import leet

    f = find_run_files(wandb_sweep)[0]
    direct = read_run(f)
    monkeypatch.delattr(leet, "_base_args")
    via_cli = read_run(f)
    assert (via_cli.summary, via_cli.config, via_cli.history) == (direct.summary, direct.config, direct.history)


def test_bad_files(tmp_path):
    bad = tmp_path / "offline-run-x" / "run-x.wandb"
    bad.parent.mkdir()
    bad.write_bytes(b"not a transaction log")
    with pytest.raises(ValueError, match="W&B could not read"):
        read_run(bad)
    with pytest.raises(FileNotFoundError, match="no such W&B run file"):
        read_run(tmp_path / "run-y.wandb")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds 0 W&B run files"):
        read_run(tmp_path / "empty")
    assert wandb_files.read_runs(tmp_path / "nothing here") == []
