"""lst-compare's reading of run directories (compare.py): curves, best values, times, clear errors, and
runs known only from W&B's offline files."""
import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml

from lst_lightning.app.compare import (
    compare, facet_groups, highlighted, is_grid, load_runs, main, natural_key, ranked)


def fake_run(root: Path, name: str, a: float, b: float, val_top5: list[float], test_top5: float) -> Path:
    d = root / name
    (d / "csv").mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({
        "name": name, "head": "FactoredSphericalHead", "loss": "zloss", "train_steps": 20,
        "val": {"top5_error": val_top5[-1]}, "test": {"top5_error": test_top5, "mrr": 0.3},
        "step_time_ms": 2.0}))
    (d / "config.yaml").write_text(yaml.safe_dump({"loss": {"name": "zloss", "kwargs": {"a": a, "b": b}}}))
    with (d / "csv" / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "step", "train/elapsed_s", "train/loss", "val/top5_error"])
        for i, v in enumerate(val_top5):
            step = 10 * (i + 1) - 1
            w.writerow([0, step, 0.5 * (i + 1), 5.0 - i, ""])
            w.writerow([0, step, "", "", v])  # Lightning's validation row: no elapsed time
    return d



def test_compare_reads_curves_best_values_and_times(tmp_path):
    fake_run(tmp_path / "sweep", "r1", 0.1, 5, [0.6, 0.4, 0.5], 0.45)
    fake_run(tmp_path / "sweep", "r2", 1.0, 5, [0.7, 0.65], 0.62)
    runs = {r.name: r for r in load_runs([tmp_path / "sweep"])}
    r1 = runs["r1"]
    assert r1.metric("best_val/top5_error") == 0.4  # the minimum over the curve, not the last
    assert r1.metric("val/top5_error") == 0.5
    assert r1.metric("loss.kwargs.a") == 0.1
    # validation points take the training time logged just before them
    assert [t for _, _, t in r1.curves["val/top5_error"]] == [0.5, 1.0, 1.5]
    assert [s for s, _, _ in r1.curves["train/loss"]] == [9.0, 19.0, 29.0]
    out = tmp_path / "out"
    res = compare([tmp_path / "sweep"], out, metric="best_val/top5_error")
    assert "heatmap.png" not in res["files"]  # one value of b: no heatmap
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert [r["run"] for r in rows] == ["r1", "r2"]
    assert float(rows[1]["best_val/top5_error"]) == 0.65


def test_a_sweeps_jobs_without_results_are_named(tmp_path, capsys):
    """A job that failed or was refused (Hydra's ``.hydra`` and no results) is not a run of the
    report, and lst-compare says so rather than reporting the others as the whole sweep."""
    fake_run(tmp_path / "sweep", "0", 0.1, 5, [0.6, 0.4], 0.45)
    (fake_run(tmp_path / "sweep", "1", 1.0, 5, [0.7], 0.62) / ".hydra").mkdir()
    (tmp_path / "sweep" / "2" / ".hydra").mkdir(parents=True)  # refused before it trained
    main([str(tmp_path / "sweep"), "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert out.startswith("2 runs")
    (line,) = err.strip().splitlines()
    assert "no results in 1 job directories" in line and line.endswith(str(tmp_path / "sweep" / "2"))


def test_best_val_of_a_metric_where_higher_is_better_is_its_maximum(tmp_path):
    fake_run(tmp_path / "sweep", "r1", 0.1, 5, [0.6, 0.4, 0.5], 0.45)
    fake_run(tmp_path / "sweep", "r2", 1.0, 5, [0.7, 0.65], 0.62)
    for name, mrr in (("r1", [0.2, 0.5, 0.4]), ("r2", [0.3, 0.45])):
        path = tmp_path / "sweep" / name / "csv" / "metrics.csv"
        rows = list(csv.DictReader(path.open()))
        values = iter(mrr)
        for row in rows:
            row["val/mrr"] = next(values) if row["val/top5_error"] else ""
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[*rows[0]])
            w.writeheader()
            w.writerows(rows)
    runs = {r.name: r for r in load_runs([tmp_path / "sweep"])}
    assert runs["r1"].metric("best_val/mrr") == 0.5  # the highest over the curve, not the lowest
    assert runs["r2"].metric("best_val/mrr") == 0.45
    assert runs["r1"].metric("best_val/top5_error") == 0.4  # errors: still the least
    assert [r.name for r in ranked(list(runs.values()), "best_val/mrr")] == ["r1", "r2"]

def test_runs_without_the_test_split_keep_their_best_validation_columns(tmp_path):
    """The synthetic sweeps run with test=false: the table still holds each run's best validation errors."""
    for name, val in (("r1", [0.6, 0.4, 0.5]), ("r2", [0.7, 0.65])):
        res = fake_run(tmp_path / "sweep", name, 0.1, 5, val, 0.5) / "results.json"
        res.write_text(json.dumps({k: v for k, v in json.loads(res.read_text()).items() if k != "test"}))
    compare([tmp_path / "sweep"], tmp_path / "out", metric="val/top5_error")
    rows = list(csv.DictReader((tmp_path / "out" / "runs.csv").open()))
    assert [(r["run"], r["best_val/top5_error"]) for r in rows] == [("r1", "0.4"), ("r2", "0.65")]
    assert not any(k.startswith("test/") for k in rows[0])



def test_compare_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no results.json"):
        compare([tmp_path], tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no such run"):
        compare([tmp_path / "missing"], tmp_path / "out")
    fake_run(tmp_path, "r1", 0.1, 5, [0.5], 0.5)
    with pytest.raises(ValueError, match="in none of the runs"):
        compare([tmp_path], tmp_path / "out", metric="test/top3_error")
    with pytest.raises(ValueError, match=r"--best must be at least 1, not 0"):
        compare([tmp_path], tmp_path / "out", best=0)
    with pytest.raises(ValueError, match=r"--curve 'val/top3_error': logged by none of the runs; available: "
                                         r"\['train/loss', 'val/top5_error'\]"):
        compare([tmp_path], tmp_path / "out", curve_keys=["train/loss", "val/top3_error"])
    with pytest.raises(ValueError, match=r"--x 'loss.kwargs.aa': no run has a number under that key"):
        compare([tmp_path], tmp_path / "out", x="loss.kwargs.aa")  # a typo: it left the heatmap out, silently
    with pytest.raises(ValueError, match=r"--y 'loss.name': no run has a number"):
        compare([tmp_path], tmp_path / "out", x="loss.kwargs.a", y="loss.name")
    assert not (tmp_path / "out").exists()  # nothing written on bad input
    assert "curves_steps.png" in compare([tmp_path], tmp_path / "out", curve_keys=["val/top5_error"])["files"]


def test_an_out_that_is_a_file_is_refused_before_anything_is_read(tmp_path):
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile", tmp_path / "afile" / "report"):
        with pytest.raises(ValueError, match=rf"^--out {out}: {tmp_path / 'afile'} is a file, not a directory$"):
            compare([tmp_path / "missing"], out)  # before the missing run directory


def test_a_run_file_that_does_not_parse_is_named(tmp_path, capsys):
    """A results.json cut short: one line naming it (its parser's message named no file)."""
    fake_run(tmp_path, "r1", 0.1, 5, [0.5], 0.5)
    (tmp_path / "r1" / "results.json").write_text('{"name": ')
    with pytest.raises(SystemExit):
        main([str(tmp_path), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"lst-compare: error: {tmp_path / 'r1' / 'results.json'} does not parse")
    assert not (tmp_path / "out").exists()


def strip(sweep: Path, dest: Path, *names: str) -> Path:
    """A copy of ``sweep`` without each job's ``names`` (results.json, csv)."""
    shutil.copytree(sweep, dest, symlinks=True)
    for job in dest.glob("*/wandb"):
        for name in names:
            p = job.parent / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return dest


def cells(rows: list[dict]) -> list:
    """runs.csv rows but the directory, numbers as numbers (W&B keeps 10.0 as 10)."""
    def value(v: str):
        try:
            return float(v)
        except ValueError:
            return v
    return [[(k, value(v)) for k, v in r.items() if k != "dir"] for r in rows]


def same_runs(a: list, b: list) -> None:
    by_name = {r.name: r for r in b}
    assert sorted(by_name) == sorted(r.name for r in a)
    for r in a:
        assert by_name[r.name].curves == r.curves
        for key in ("test/top5_error", "best_val/top5_error", "val/mrr", "loss.kwargs.a", "step_time_ms", "wall_s"):
            assert by_name[r.name].metric(key) == pytest.approx(r.metric(key)), key


def test_a_sweep_logged_only_to_wandb_gets_the_same_report(wandb_sweep, tmp_path):
    only_wandb = strip(wandb_sweep, tmp_path / "only_wandb", "results.json", "csv")
    same_runs(load_runs([wandb_sweep]), load_runs([only_wandb]))
    res = compare([only_wandb], tmp_path / "out", metric="best_val/top5_error", x="a", y="loss.kwargs.a")
    assert res["runs"] == 2 and "curves_time.png" in res["files"]
    ours = list(csv.DictReader((tmp_path / "out" / "runs.csv").open()))
    theirs = compare([wandb_sweep], tmp_path / "out2", metric="best_val/top5_error")
    want = list(csv.DictReader((tmp_path / "out2" / "runs.csv").open()))
    assert theirs["runs"] == 2
    assert cells(ours) == cells(want)  # same columns in the same order, same values


def test_a_run_without_its_csv_log_takes_wandb_history(wandb_sweep, tmp_path):
    no_csv = strip(wandb_sweep, tmp_path / "no_csv", "csv")
    same_runs(load_runs([wandb_sweep]), load_runs([no_csv]))


def test_names_sort_by_their_numbers():
    names = ["r[b=10]", "r[b=2]", "r[a=0.5]", "r[a=0.05]", "r[b=1e-3]", "r[b=20]"]
    assert sorted(names, key=natural_key) == ["r[a=0.05]", "r[a=0.5]", "r[b=1e-3]", "r[b=2]", "r[b=10]", "r[b=20]"]


def sweep_of(root: Path, a_values, b_values) -> list:
    """A fake a x b sweep whose test error falls with b and rises with a."""
    for a in a_values:
        for b in b_values:
            err = 0.5 + a / 10 - b / 1000
            fake_run(root, f"zloss[a={a},b={b}]", a, b, [err + 0.1, err], err)
    return load_runs([root])


def test_a_sweep_shows_its_best_runs_in_numeric_order_and_a_faceted_view(tmp_path):
    runs = sweep_of(tmp_path / "sweep", [0.05, 0.5, 1], [2, 5, 10, 20])
    shown, rest = highlighted(runs, "test/top5_error", best=3)
    assert [r.name for r in shown] == ["zloss[a=0.05,b=5]", "zloss[a=0.05,b=10]", "zloss[a=0.05,b=20]"]
    assert len(rest) == 9 and rest[0].name == "zloss[a=0.05,b=2]"  # the next best first
    few, none = highlighted(runs[:3], "test/top5_error", best=3)
    assert len(few) == 3 and not none
    for r, mrr in zip(runs, range(len(runs))):  # a metric where higher is better
        r.results["test"]["mrr"] = mrr / 100
    assert ranked(runs, "test/mrr")[0] is runs[-1]
    by, panels = facet_groups(runs, "loss.kwargs.a", "loss.kwargs.b")
    assert by == "loss.kwargs.a" and [t for t, _ in panels] == ["loss.kwargs.a=0.05", "loss.kwargs.a=0.5",
                                                                  "loss.kwargs.a=1"]
    assert [label for label, _ in panels[0][1]] == [f"loss.kwargs.b={b}" for b in (2, 5, 10, 20)]
    by, panels = facet_groups(runs[:4], "loss.kwargs.a", "loss.kwargs.b")  # one value of a: panels by b
    assert by == "loss.kwargs.b" and len(panels) == 4
    res = compare([tmp_path / "sweep"], tmp_path / "out", best=3)
    assert {"curves_steps.png", "curves_time.png", "curves_facets.png", "heatmap.png"} <= set(res["files"])
    rows = list(csv.DictReader((tmp_path / "out" / "runs.csv").open()))
    assert rows[0]["run"] == "zloss[a=0.05,b=20]"  # best first
    small = compare([tmp_path / "sweep" / "zloss[a=1,b=2]"], tmp_path / "one")
    assert "curves_facets.png" not in small["files"]  # a few runs: every curve in colour, no facets


def test_a_grid_is_drawn_as_cells_and_a_search_as_points(tmp_path, monkeypatch):
    """An Optuna or random search (every run at its own a and b) is no grid: drawn as cells it
    would be a sparse board of lone squares; it is drawn as points, the best one ringed."""
    assert is_grid(9, 3, 3) and is_grid(5, 3, 3) and not is_grid(4, 3, 3) and not is_grid(16, 16, 16)
    import lst_lightning.app.compare as compare_module

    drawn = []
    for kind in ("grid_map", "search_map"):
        real = getattr(compare_module, kind)
        monkeypatch.setattr(compare_module, kind, lambda *a, _k=kind, _r=real: (drawn.append(_k), _r(*a))[1])
    for i, (a, b) in enumerate([(0.004, 2.0), (0.02, 9.0), (0.07, 29.0), (0.2, 39.0), (0.9, 21.0)]):
        fake_run(tmp_path / "search", f"t{i}", a, b, [0.5 - 0.01 * i], 0.5 - 0.01 * i)
    for i, (a, b) in enumerate([(0.1, 5), (0.1, 10), (1.0, 5), (1.0, 10)]):
        fake_run(tmp_path / "grid", f"g{i}", a, b, [0.5 - 0.01 * i], 0.5 - 0.01 * i)
    assert "heatmap.png" in compare([tmp_path / "search"], tmp_path / "out_search")["files"]
    assert "heatmap.png" in compare([tmp_path / "grid"], tmp_path / "out_grid")["files"]
    assert drawn == ["search_map", "grid_map"]


def resumed_wandb_run(run_dir: Path) -> None:
    """Two offline parts of one W&B run, as a resume from a checkpoint at step 5 writes them: the
    first logged steps 0 to 7 (6 and 7 lost with the interruption), the second 5 to 9."""
    import time

    import wandb
    for part, steps in enumerate((range(0, 8), range(5, 10))):
        run = wandb.init(mode="offline", dir=run_dir, id="abc123", resume="allow", project="p", name="resumed",
                         settings=wandb.Settings(silent=True))
        for s in steps:
            run.log({"trainer/global_step": s, "val/mrr": s / 10 + part})
        run.finish()
        time.sleep(1.1)  # the parts' directories are named by the second they started


def test_a_resumed_runs_wandb_parts_are_one_run_with_one_history(tmp_path):
    """A run resumed from its checkpoints logs a W&B part a resume, under one run id: without a
    CSV log its curves are every part's (the last part alone was read), and without a results.json
    it is one run (one a part); the steps the resume took again are the later part's."""
    run_dir = tmp_path / "sweep" / "r1"
    resumed_wandb_run(run_dir)
    want = [(float(s), s / 10 + (s >= 5), None) for s in range(10)]
    (only_wandb,) = load_runs([tmp_path / "sweep"])
    assert only_wandb.path.resolve() == run_dir.resolve() and only_wandb.curves["val/mrr"] == want
    (d := tmp_path / "with_results" / "r1").mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"name": "r1", "test": {"mrr": 0.3}}))
    shutil.copytree(run_dir / "wandb", d / "wandb")
    (with_results,) = load_runs([tmp_path / "with_results"])
    assert with_results.curves["val/mrr"] == want
