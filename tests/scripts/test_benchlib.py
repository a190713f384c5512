"""scripts/benchlib.py: output folders, CSV, markdown, timing in alternation, targets."""
from __future__ import annotations

import argparse
import csv
import importlib

import benchlib
import pytest
import torch
from output_sandbox import COMMITTED, tree_hashes


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    benchlib.add_output_args(p)
    return p.parse_args(argv)


def test_default_output_folders_are_fresh_even_within_a_second(sandbox):
    first, second = (benchlib.output_dir(parse(), "x") for _ in range(2))
    assert first != second
    assert first.resolve().parent == second.resolve().parent == sandbox.cwd / "outputs" / "bench" / "x"
    assert not any(first.iterdir()) and not any(second.iterdir())


def test_out_and_update_results(sandbox, tmp_path):
    assert benchlib.output_dir(parse("--out", str(tmp_path / "o")), "x") == tmp_path / "o"
    assert benchlib.output_dir(parse("--update-results"), "x") == sandbox.results
    with pytest.raises(SystemExit):
        parse("--out", "o", "--update-results")


def test_csv_names_the_machine_and_appends_under_one_header(tmp_path):
    path = tmp_path / "t.csv"
    benchlib.write_csv(path, [{"a": 1, "b": 2}])
    benchlib.write_csv(path, [{"a": 3, "b": 4, "extra": 5}], append=True)
    benchlib.write_csv(path.with_name("u.csv"), [{"machine": "elsewhere", "a": 1}])
    rows = list(csv.DictReader(path.open()))
    where = benchlib.provenance()
    assert rows == [{**where, "a": "1", "b": "2"}, {**where, "a": "3", "b": "4"}]
    assert next(csv.DictReader(path.with_name("u.csv").open()))["machine"] == "elsewhere"


def test_every_csv_names_the_machine_torch_commit_and_date_of_its_rows(tmp_path):
    """A run's CSV says where it was measured, as the tidy CSVs it is added to do; the rows' own values kept."""
    path = benchlib.write_csv(tmp_path / "t.csv", [{"a": 1}, {"a": 2, "torch": "9.9"}], ["a"])
    header, *rows = csv.reader(path.open())
    assert header == ["machine", "a", "torch", "commit", "date"]
    assert rows[0][2:] == [torch.__version__, benchlib.provenance()["commit"], benchlib.provenance()["date"]]
    assert rows[0][3] != "unknown" and rows[1][2] == "9.9"


def test_markdown_table():
    md = benchlib.markdown_table([{"h": "x", "v": 1 / 3, "n": None}], ["h", "v", "n"], right=["v"])
    assert md == "| h | v | n |\n|---|---:|---|\n| x | 0.3333 |  |"


def test_interleaved_times_alternate_and_keep_every_timing():
    calls = []
    steps = {"a": (lambda: calls.append("a"), 2), "b": (lambda: calls.append("b"), 1)}
    times = benchlib.interleaved_times(steps, rounds=2, warmup=1)
    assert calls == ["a", "b"] + ["a", "a", "b"] * 2
    assert [len(times["a"]), len(times["b"])] == [4, 2]
    assert benchlib.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_zipf_targets_follow_the_synthetic_tasks_law():
    y = benchlib.zipf_targets((4000, 2), 1000, torch.Generator().manual_seed(0))
    assert y.shape == (4000, 2) and y.dtype == torch.long and 0 <= y.min() and y.max() < 1000
    # P(r) ~ log((r + 2) / (r + 1)): class 0 takes log 2 / log 1001 of the draws, about 10 %.
    assert (y == 0).float().mean().item() == pytest.approx(0.1003, abs=0.015)


@pytest.mark.parametrize("script, argv, rows", [("tf32_drift", ["--smoke", "--loss", "zloss"], 4),
                                                ("launch_cost", ["--smoke"], 3)])
def test_update_results_adds_the_rows_to_the_results_folder_only(sandbox, script, argv, rows):
    """``save_rows`` under --update-results: the rows appended to the results folder's tidy CSV (here
    $LST_RESULTS_DIR's) with the command, nothing else written there (no raw file left), and the committed
    folder untouched (results_pages.py's ``add`` wrote into it whatever the results folder; tf32_drift.py's
    rows, which no page shows, were refused by it after the run, in a traceback)."""
    def main(args):
        importlib.import_module(script).main(args)  # tf32_drift's returns its rows
    committed = tree_hashes(COMMITTED)
    before = list(csv.DictReader((sandbox.results / f"{script}.csv").open()))
    assert sandbox.run_update(main, argv) == {f"{script}.csv"}
    after = list(csv.DictReader((sandbox.results / f"{script}.csv").open()))
    assert after[:len(before)] == before and len(after) == len(before) + rows
    assert after[-1]["command"] == f"python3 scripts/{script}.py {' '.join(argv)} --update-results"
    assert tree_hashes(COMMITTED) == committed


def test_positive_int_and_existing_path_refuse_in_argparses_one_line(tmp_path):
    assert benchlib.positive_int("3") == 3 and benchlib.existing_path(str(tmp_path)) == tmp_path
    for bad in ("0", "-5", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            benchlib.positive_int(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        benchlib.existing_path(str(tmp_path / "absent.csv"))


@pytest.mark.parametrize("script, argv", [
    ("bench_heads", ["--replot", "absent.csv"]),
    ("bench_whole_step", ["--smoke", "--merge", "absent.csv"]),
    ("bench_whole_step", ["--smoke", "--threads", "-1"]),
    ("bench_head_cpu", ["--smoke", "--reps", "0"]),
    ("bench_checkpoints", ["--smoke", "--repeats", "0"]),
    ("bench_checkpoints", ["--long", "20", "--short", "20"]),
    ("bench_routes", ["--smoke", "--D", "-5"]),
    ("bench_routes", ["--smoke", "--threads", "0"]),
    ("bench_samplers", ["--sizes", "-5"]),
    ("bench_samplers", ["--reps", "0"]),
    ("bench_sharded", ["--world", "0"]),
    ("bench_sharded", ["--D", "-5"]),
    ("bench_sparse_exchange", ["--D", "-5"]),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_bad_sizes_and_missing_files_are_one_line_exit_2_and_write_nothing(sandbox, capsys, script, argv):
    """A size that cannot run or a file that is not there: argparse's one-line error, before any
    folder or file is made (these ran, crashed in a traceback, or started jobs that failed)."""
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: " in err[-1] and "Traceback" not in "\n".join(err)
    assert not (sandbox.cwd / "outputs").exists()


HELPED = ["bench_heads", "bench_kernels", "bench_routes", "bench_samplers", "bench_sharded", "bench_sparse_exchange",
          "bench_step_cpu", "bench_whole_step", "count_step", "crossover", "gpu_session", "launch_cost", "logit_spread",
          "profile_step", "quality_table", "results_pages", "time_to_quality", "trace_step"]


@pytest.mark.parametrize("script", HELPED)
def test_help_describes_the_script_in_its_docstrings_whole_first_paragraph(script, capsys):
    """``--help`` says what the script does in whole sentences (it ended in mid-sentence at the docstring's first line)."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    first = "".join(module.__doc__.split("\n\n")[0].split())  # argparse rewraps it, at hyphens too
    assert first in "".join(capsys.readouterr().out.split())
