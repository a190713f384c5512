"""scripts/results_pages.py: the committed results pages, their plots and the README's key
figures are what the script makes of the committed CSVs, byte for byte; the CSVs are tidy."""
from __future__ import annotations

import csv

import pytest
import results_pages as rp


@pytest.fixture(scope="module")
def made():
    return rp.expected()


def test_every_committed_page_plot_and_the_readme_figures_are_what_the_data_makes(made):
    assert rp.differing(made) == [], "run: uv run python scripts/results_pages.py"


def test_a_plot_is_held_byte_for_byte_to_the_matplotlib_that_made_it_and_a_page_always(tmp_path, monkeypatch):
    """The lock holds another matplotlib for Python 3.10, which lays a plot out differently: there a
    committed plot is held to exist, and the pages to their bytes as everywhere."""
    monkeypatch.setattr(rp, "PAGES", tmp_path)
    plot, page = tmp_path / "p.svg", tmp_path / "p.md"
    ours = f"<svg><dc:title>{rp.made_with()}</dc:title>width=1</svg>"
    plot.write_text(ours.replace("width=1", "width=2"))
    page.write_text("a page")
    assert rp.differing({plot: ours, page: "a page"}) == [plot]
    plot.write_text("<svg><dc:title>matplotlib 0.1</dc:title>width=2</svg>")
    assert rp.differing({plot: ours, page: "a page"}) == []
    assert rp.differing({plot: ours, page: "another page"}) == [page]
    plot.unlink()
    assert rp.differing({plot: ours, page: "a page"}) == [plot]


def test_the_readme_holds_at_most_eight_key_figures_each_naming_machine_torch_and_date(made):
    assert len(made[rp.README].splitlines()) <= 150  # a newcomer reads it in five minutes
    block = made[rp.README].split(rp.KEY_START)[1].split(rp.KEY_END)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert 1 <= len(rows) <= 8
    for row in rows:
        measured_on = row.split(" | ")[-1]
        assert "torch 2." in measured_on and "20" in measured_on and "docs/results/" in measured_on, row


@pytest.mark.parametrize("page", rp.PAGE_LIST, ids=lambda p: p.name)
def test_every_csv_is_tidy(page):
    """Every row names its machine, torch, commit, date and command; every other column not named as
    text holds numbers only."""
    with (rp.DATA / f"{page.name}.csv").open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert list(reader.fieldnames[-5:]) == list(rp.META)
        rows = list(reader)
    assert rows
    for r in rows:
        assert all(r[k] for k in rp.META), r
        assert len(r["date"]) == 10 and r["date"][4] == "-", r["date"]
        for k, v in r.items():
            if k not in rp.TEXT and v != "":
                float(v)


def test_a_changed_figure_makes_the_check_fail(made, monkeypatch):
    """The check compares bytes: one changed measurement changes a page."""
    loaded = {name: rp.load(name) for name in [p.name for p in rp.PAGE_LIST] + ["time_to_quality_curves"]}
    loaded["sharded"][0]["step_ms"] += 1
    monkeypatch.setattr(rp, "load", loaded.__getitem__)
    changed = rp.expected()
    assert changed[rp.PAGES / "sharded.md"] != made[rp.PAGES / "sharded.md"]


def test_add_appends_a_runs_rows_with_their_provenance(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "sharded.csv").write_text((rp.DATA / "sharded.csv").read_text())
    monkeypatch.setattr(rp, "DATA", data)
    raw = tmp_path / "bench_sharded_x.csv"
    raw.write_text("machine,D,d,m_per_rank,world,global_batch,step_ms,v_gb_per_rank,comm_mb_per_step,setup_s,extra\n"
                   "box,1000,8,4,2,8,1.5,0.1,0.01,2.0,ignored\n")
    n = rp.add_rows("sharded", raw, "python scripts/bench_sharded.py --D 1000", torch_version="2.13.0", commit="abc1234",
                    date="2030-01-02")
    assert n == 1
    last = list(csv.DictReader((data / "sharded.csv").open()))[-1]
    assert (last["machine"], last["D"], last["step_ms"], last["commit"], last["date"]) == (
        "box", "1000", "1.5", "abc1234", "2030-01-02")
    assert last["command"] == "python scripts/bench_sharded.py --D 1000" and "extra" not in last
    bad = tmp_path / "bad.csv"
    bad.write_text("machine,D,step_ms\nbox,1000,fast\n")
    with pytest.raises(ValueError):
        rp.add_rows("sharded", bad, "x", machine="box", torch_version="2.13.0", commit="a", date="2030-01-02")


def test_add_refuses_a_raw_csv_without_a_column_of_the_tidy_one_in_one_line(tmp_path, monkeypatch, capsys):
    """A run's CSV that lacks a column of the tidy CSV (bench_head_cpu.py's ``run``) or is not there:
    one line, exit 2, the tidy CSV as it was."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "head_step_cpu.csv").write_text((rp.DATA / "head_step_cpu.csv").read_text())
    monkeypatch.setattr(rp, "DATA", data)
    before = (data / "head_step_cpu.csv").read_bytes()
    raw = tmp_path / "head_cpu_quick_x.csv"
    raw.write_text("machine,torch,threads,group,impl,D,d,m,ms\nbox,2.13.0,1,scaling,factored,1000,8,4,1.5\n")
    for path, why in ((raw, "has no column run of head_step_cpu.csv"), (tmp_path / "absent.csv", "No such file")):
        with pytest.raises(SystemExit) as e:
            rp.main(["add", "head_step_cpu", str(path), "--command", "x"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "error: " in err and str(path) in err and why in err
        assert (data / "head_step_cpu.csv").read_bytes() == before


@pytest.mark.parametrize("page", [p for p in rp.PAGE_LIST if "threads" in rp.load(p.name)[0]],
                         ids=lambda p: p.name)
def test_each_pages_command_runs_with_its_rows_threads_and_leaves_the_data_alone(page, made):
    """A page's commands reproduce its rows: each row's thread count is in the command the page
    gives for it, and no command writes into benchmarks/results/."""
    text = made[rp.PAGES / f"{page.name}.md"]
    assert rp.UPDATE_FLAG not in text
    for row in rp.load(page.name):
        command = rp.page_command(row)
        assert f"--threads {row['threads']}" in command or f"--threads={row['threads']}" in command, command
        assert f"`{command}`" in text, command


def test_a_pair_of_two_variants_is_summed_up_against_the_rivals_variant():
    """``default;X`` against ``sampled_softmax;X`` (both compiled, say) is a pair of the table, the
    rival named as itself with its settings; each pair once."""
    def row(head, rival, seed, mrr):
        return {"mode": "equal_time", "case": "python_code", "D": 100_000, "budget_s": 90.0, "machine": "box",
                "seed": seed, "commit": "abc", "head": head, "rival": rival, "val_mrr": mrr}
    ours, theirs = "default;compile=true", "sampled_softmax;compile=true"
    rows = [row(ours, theirs, s, 0.5) for s in (0, 1)] + [row(theirs, ours, s, 0.4) for s in (0, 1)]
    pairs = rp.ttq_pairs(rows)
    assert list(pairs) == [("python_code", 100_000, 90.0, "box", ours, theirs)]
    assert [(a["val_mrr"], b["val_mrr"]) for a, b in pairs[list(pairs)[0]]] == [(0.5, 0.4)] * 2
    assert rp.variant_name(theirs) == "the sampled softmax, `compile=true`" and rp.variant_name(ours) == "`compile=true`"
    # as shipped, a head is the rival of its variants
    assert list(rp.ttq_pairs([row("default;x=1", "default", 0, 0.5), row("default", "default;x=1", 0, 0.4)])) == [
        ("python_code", 100_000, 90.0, "box", "default;x=1", "default")]


def test_a_pages_command_leaves_out_the_runs_output_folder():
    """A row's recorded ``--out`` (a folder of the machine that ran it, or a placeholder) is not
    part of the command a page gives: run again, the script makes a fresh folder of its own."""
    row = {"command": "python3 scripts/compiled_step.py --batch-sizes --out DIR --m 1000 --update-results"}
    assert rp.page_command(row) == "python3 scripts/compiled_step.py --batch-sizes --m 1000"
    assert rp.page_command({"command": "python3 s.py --out=/tmp/x --m 8"}) == "python3 s.py --m 8"
    assert "--out" not in "".join(p.read_text() for p in rp.PAGES.glob("*.md"))
