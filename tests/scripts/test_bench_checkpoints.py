"""scripts/bench_checkpoints.py: tiny lst-train runs with and without periodic checkpoints,
their per-step times and the recompute cost, in the run directory (the smoke run is slow:
``uv run pytest -m slow tests/scripts/test_bench_checkpoints.py``); the runs' length and a
measurement appended to the committed CSV as a series of its own, with lst-train faked."""
from __future__ import annotations

import csv
import json
import types

import bench_checkpoints as bc
import pytest

MACHINE = "AMD-EPYC-2cores"



def test_a_smoke_run_keeps_the_sizes_it_is_given(tmp_path, monkeypatch):
    """``--smoke`` makes tiny defaults: a size given on the command line still counts."""
    seen = []

    def train(run_dir, D, steps, setting, args):
        seen.append((args.D, args.short, args.long, args.hidden_dim))
        raise SystemExit(0)
    monkeypatch.setattr(bc, "train", train)
    with pytest.raises(SystemExit):
        bc.main(["--smoke", "--D", "500", "--out", str(tmp_path)])
    assert seen == [([500], bc.SMOKE["short"], bc.SMOKE["long"], bc.SMOKE["hidden_dim"])]

@pytest.mark.slow  # four lst-train processes: about two minutes on the 2-core machine
def test_smoke_writes_a_row_per_setting(sandbox):
    run_dir = sandbox.run_default(bc.main, ["--smoke"], "bench_checkpoints")
    stem = run_dir / f"checkpoints_{bc.machine_name()}"
    rows = list(csv.DictReader(stem.with_suffix(".csv").open()))
    assert [(r["D"], r["setting"]) for r in rows] == [("300", "none"), ("300", "steps1000_async")]
    # a step's time is the two runs' difference: at smoke sizes the noise may outweigh it, and then
    # nothing is written (``measured``), never a time of 0 or below
    assert all(r["ratio_to_none"] == "" or float(r["ratio_to_none"]) > 0 for r in rows)
    assert all(r["step_ms"] == "" or float(r["step_ms"]) > 0 for r in rows)
    assert all(float(r["ckpt_mb"]) > 0 and float(r["recompute_s"]) > 0 for r in rows)
    assert int(rows[0]["recomputable_bytes"]) == 4 * (9 * 9 + 9 + 9 * 9)  # Q, wbar, U^-1 at d + 1 = 9, float32
    assert stem.with_suffix(".md").read_text().count("| 300 |") == 2 and stem.with_suffix(".png").stat().st_size > 0


def fake_lst_train(stopped_at=None):
    """subprocess.run in place of lst-train: results.json with the steps asked for (or
    ``stopped_at``) and a periodic save's in-run cost; the command lines it was given."""
    seen = []

    def run(cmd, **_):
        seen.append(cmd)
        over = dict(a.split("=", 1) for a in cmd if "=" in a)
        steps = int(over["trainer.max_steps"])
        run_dir = bc.Path(over["hydra.run.dir"])
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x" * 1024)
        in_run = {"periodic_saves": 2, "held_s": 1.0, "written_s": 3.0, "train_s": 100.0, "share": 0.03}
        (run_dir / "results.json").write_text(json.dumps({"train_steps": stopped_at or steps, "checkpoints": in_run}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")
    return run, seen


def test_a_run_ends_at_the_steps_asked_for_or_the_measurement_stops(tmp_path, monkeypatch):
    """The trainer's own limit (2 epochs of 2 000 batches) is lifted; a run that still ends
    early (an override) is an error, not a per-step time over other steps than asked."""
    run, seen = fake_lst_train()
    monkeypatch.setattr(bc.subprocess, "run", run)
    args = types.SimpleNamespace(max_input_vocab=10**6, overrides=[], hidden_dim=None)
    assert bc.train(tmp_path / "a", 10**6, 5020, "budget", args)["steps"] == 5020
    assert "trainer.max_epochs=-1" in seen[0]
    run, _ = fake_lst_train(stopped_at=4000)
    monkeypatch.setattr(bc.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="stopped at 4000 of 5020 steps"):
        bc.train(tmp_path / "b", 10**6, 5020, "budget", args)


def test_a_series_is_appended_to_the_committed_csv(sandbox, monkeypatch):
    """--series with --update-results: the rows, labelled, after every earlier series (kept as
    they were), with the in-run share of the periodic saves."""
    run, _ = fake_lst_train()
    monkeypatch.setattr(bc.subprocess, "run", run)
    monkeypatch.setattr(bc, "machine_name", lambda: MACHINE)
    monkeypatch.setattr(bc, "recompute_cost", lambda D, d: {"recompute_s": 0.5, "recomputable_bytes": 7, "V_mb": 1.0})
    path = sandbox.results / f"checkpoints_{MACHINE}.csv"
    sandbox.run_update(bc.main, ["--D", "10000", "--settings", "none", "--series", "E: an earlier one"])
    before = path.read_text()
    changed = sandbox.run_update(bc.main, ["--D", "10000", "--settings", "none", "budget", "--series", "F: a test"])
    assert f"checkpoints_{MACHINE}.csv" in changed
    after = path.read_text()
    assert after.startswith(before)
    new = list(csv.DictReader(after.splitlines()))[len(list(csv.DictReader(before.splitlines()))):]
    assert [(r["series"], r["D"], r["setting"], r["in_run_share"]) for r in new] == [
        ("F: a test", "10000", "none", "0.03"), ("F: a test", "10000", "budget", "0.03")]
    table = path.with_suffix(".md").read_text()  # every series of the CSV, this one among them
    series = {r["series"] for r in csv.DictReader(after.splitlines())}
    assert len(series) > 1 and all(f"| {s} |" in table for s in series), table[:400]


def test_a_step_time_below_the_runs_noise_is_not_written():
    """The long run no slower than the short one: no step time (None, an empty cell), not a negative one."""
    assert bc.measured(-345.4) is None and bc.measured(0.0) is None and bc.measured(2.5) == 2.5
