"""scripts/bench_heads.py: the smoke run's outputs and where they go, skip reasons, the
loss settings it reads, and the ratio and target arithmetic."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import bench_heads as bh
import pytest
import torch
from output_sandbox import make_sandbox

# The GPU machine has torch, matplotlib, PyYAML and rich but not the app's other packages.
NOT_ON_THE_GPU_MACHINE = ("hydra", "omegaconf", "datasets", "gensim", "wandb")


def read_rows(folder: Path) -> list[dict]:
    (path,) = folder.glob("bench_heads_smoke_*.csv")
    with path.open() as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == [*bh.COLUMNS, "commit", "date"]
        return list(reader)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The smoke run with no output option, from a temporary current directory: its run
    directory (the sandbox checks that no results folder changed)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the smoke run times the CUDA paths; this test pins the CPU run")
    with pytest.MonkeyPatch.context() as mp:
        box = make_sandbox(tmp_path_factory.mktemp("smoke"), mp)
        return box.run_default(bh.main, ["--smoke"], "bench_heads")


def test_default_run_writes_its_run_directory_only(smoke_run):
    assert smoke_run.parent.name == "bench_heads" and smoke_run.parent.parent.name == "bench"
    assert sorted(p.suffix for p in smoke_run.iterdir()) == [".csv", ".md", ".png"]


def test_update_results_writes_the_results_folder(sandbox):
    changed = sandbox.run_update(bh.main, ["--smoke", "--cpu", "--heads", "factored/zloss"])
    machine = bh.machine_name()
    assert changed == {f"bench_heads_smoke_{machine}{s}" for s in (".csv", ".md", ".png")}


def test_smoke_writes_every_head_at_every_size(smoke_run):
    rows = read_rows(smoke_run)
    sizes = bh.SIZES["smoke"]
    assert {(r["head"], r["variant"]) for r in rows} == {s.key for s in bh.HEADS}
    for spec in bh.HEADS:
        mine = [r for r in rows if (r["head"], r["variant"]) == spec.key]
        assert sorted(int(r["D"]) for r in mine) == sorted(sizes["D"]), spec
        for r in mine:
            assert (int(r["d"]), int(r["m"]), r["device"]) == (sizes["d"][0], sizes["m"][0], "cpu")
            if spec.cuda_only:
                assert r["status"] == "skipped: CUDA only" and r["median_ms"] == ""
            elif spec.key == ("softmax", "torch") and not hasattr(torch.nn.functional, "linear_cross_entropy"):
                assert r["status"].startswith("not installed: F.linear_cross_entropy: new in torch 2.13"), r
            else:
                assert r["status"] == "ok", r
                p10, med, p90 = (float(r[k]) for k in ("p10_ms", "median_ms", "p90_ms"))
                assert 0 < p10 <= med <= p90
                assert int(r["steps"]) >= 2
    md = next(smoke_run.glob("bench_heads_smoke_*.md")).read_text()
    assert "## Targets" in md and "| factored/zloss fp32 |" in md
    assert md.count("UNMEASURED") == 6  # no GPU rows: every target unmeasured, none invented
    assert next(smoke_run.glob("bench_heads_smoke_*.png")).stat().st_size > 0


def test_imports_without_the_apps_packages():
    block = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_ON_THE_GPU_MACHINE!r}:
            raise ImportError(name)
sys.meta_path.insert(0, Block())
import bench_heads
assert bench_heads.loss_settings("zloss", 1000)[0] == 1.0
"""
    subprocess.run([sys.executable, "-c", block], cwd=Path(bh.__file__).parent, check=True)


def test_loss_settings_are_the_configs(tmp_path, monkeypatch):
    assert bh.loss_settings("zloss", 1000) == (1.0, {})  # the loss's own defaults (conf/loss restates none)
    assert bh.loss_settings("spherical_softmax", 1000) == (0.01, {})
    # A config that cannot be read stops the run rather than timing other settings.
    monkeypatch.setattr(bh, "config_dir", lambda: str(tmp_path))
    with pytest.raises(FileNotFoundError):
        bh.loss_settings("zloss", 1000)
    (tmp_path / "loss").mkdir()
    (tmp_path / "loss" / "zloss.yaml").write_text("name: zloss\nkwargs: [1]\n")
    with pytest.raises(ValueError, match="kwargs"):
        bh.loss_settings("zloss", 1000)


def test_tiny_memory_limit_records_skip_reasons(tmp_path):
    assert bh.main(["--smoke", "--cpu", "--max-gb", "1e-6", "--heads", "factored/zloss,naive,softmax/torch",
                    "--out", str(tmp_path)]) == 0
    rows = read_rows(tmp_path)
    assert len(rows) == 3 * len(bh.SIZES["smoke"]["D"])
    for r in rows:
        assert r["status"].startswith("skipped: needs ~") and "GB available" in r["status"], r
        assert r["median_ms"] == ""


def test_unknown_head_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bh.main(["--smoke", "--heads", "factored/nope", "--out", str(tmp_path)])
    assert "unknown heads" in capsys.readouterr().err


def row(head, variant, ms, device="cuda", dtype="fp32", D=793_471, d=512, m=1024, mb="", status="ok"):
    return dict(device=device, head=head, variant=variant, dtype=dtype, D=D, d=d, m=m, median_ms=ms,
                peak_extra_mb=mb, status=status)


def made_up_table() -> list[dict]:
    return [
        row("factored", "zloss", 0.1, mb=12.5),
        row("softmax", "torch", 6.0, dtype="bf16"),          # 60x
        row("softmax", "liger", 1.5, dtype="bf16"),          # 15x: the faster of the fused two
        row("softmax", "cce", 3.0, dtype="bf16"),
        row("naive", "zloss", "", status="skipped: needs ~99 GB > 70 GB available"),
        row("factored", "zloss", 0.08, D=10_000),
        row("factored", "zloss", 0.092, D=20_000_000),       # 1.15x: not flat
        row("factored", "zloss", 0.05, D=793_471, d=300, m=128),
        row("naive", "zloss", 250.0, device="cpu", D=793_471, d=300, m=128),   # 5000x
        row("naive", "zloss", 20.0, D=793_471, d=300, m=128),                  # 400x
    ]


def test_speedups_divide_by_the_factored_step_of_the_same_size_and_device():
    sp = {(s["device"], s["D"], s["d"], s["m"], s["head"]): s["ratio"] for s in bh.speedups(made_up_table())}
    assert sp[("cuda", 793_471, 512, 1024, "softmax/torch bf16")] == pytest.approx(60.0)
    assert sp[("cuda", 793_471, 512, 1024, "softmax/liger bf16")] == pytest.approx(15.0)
    assert sp[("cuda", 793_471, 300, 128, "naive/zloss fp32")] == pytest.approx(400.0)
    # A skipped row and a row on another device have no ratio; only factored rows are references.
    assert not any(k[4].startswith("naive") and k[2] == 512 for k in sp)
    assert not any(k[0] == "cpu" for k in sp)
    assert len(sp) == 4


def find_check(checks: list[dict], start: str) -> dict:
    (found,) = [c for c in checks if c["check"].startswith(start)]
    return found


def test_target_checks_from_a_made_up_table():
    checks = bh.target_checks(made_up_table())
    by_start = lambda text: find_check(checks, text)  # noqa: E731
    assert by_start("factored (zloss) step <= 0.2 ms")["status"] == "PASS"
    lce = by_start(">= 50x faster than F.linear_cross_entropy")
    assert (lce["status"], lce["value"]) == ("PASS", "60.0x (factored)")
    fused = by_start(">= 20x faster than the faster")
    assert fused["status"] == "FAIL" and fused["value"].startswith("15.0x (vs liger")
    assert by_start("factored step takes <= 64 MB")["status"] == "PASS"
    flat = by_start("flat in D")
    assert (flat["status"], flat["value"]) == ("FAIL", "1.150x (factored)")
    cpu = by_start("paper: GPU factored vs naive on CPU")
    assert (cpu["status"], cpu["value"]) == ("PASS", "5000x (factored)")
    gpu = by_start("paper: GPU factored vs naive on GPU")
    assert (gpu["status"], gpu["value"]) == ("FAIL", "400x (factored)")


def test_target_checks_take_the_fastest_factored_path():
    table = made_up_table() + [row("factored_graph", "zloss", 0.05, mb=70.0),
                               row("factored_sync", "zloss", 0.07, mb=1.0),
                               row("factored_graph", "zloss", 0.06, D=20_000_000),
                               row("factored_graph", "zloss", 0.057, D=10_000)]
    checks = bh.target_checks(table)
    assert find_check(checks, "factored (zloss) step")["value"] == "0.05 ms (factored_graph)"
    assert find_check(checks, ">= 20x faster than the faster")["value"].startswith("30.0x")
    assert find_check(checks, "factored step takes <= 64 MB")["status"] == "FAIL"  # the graph's memory
    flat = find_check(checks, "flat in D")  # the graph path at both ends, not the plain step at 10k
    assert (flat["status"], flat["value"]) == ("PASS", "1.053x (factored_graph)")


def test_target_checks_say_unmeasured_rather_than_guess():
    table = [r for r in made_up_table() if r["head"] != "softmax" or r["variant"] == "torch"]
    table[0]["peak_extra_mb"] = ""
    checks = bh.target_checks(table)
    assert find_check(checks, ">= 20x faster than the faster")["status"] == "UNMEASURED"
    assert find_check(checks, "factored step takes <= 64 MB")["status"] == "UNMEASURED"
    assert find_check(checks, "factored (zloss) step <= 0.2 ms")["status"] == "PASS"
    # CPU rows never stand in for the GPU targets.
    cpu_only = [dict(r, device="cpu") for r in made_up_table()]
    assert {c["status"] for c in bh.target_checks(cpu_only)} == {"UNMEASURED"}


def test_measure_times_a_slow_step_twice_and_keeps_the_second():
    """A step over max_step_s is timed once more (its first call may have compiled) and not
    repeated after that; a step slow only at its first call is timed as usual."""
    calls = {"slow": 0, "fast": 0, "compiles": 0}

    def fake_clock(fn):
        fn()
        if fn is compiles:
            return 4.0 if calls["compiles"] == 1 else 0.002
        return (5.0 + calls["slow"]) if fn is slow else 0.001

    def slow():
        calls["slow"] += 1

    def fast():
        calls["fast"] += 1

    def compiles():
        calls["compiles"] += 1

    opt = bh.TimingOptions(warmup=2, budget_s=0.05, min_steps=3, max_steps=10, max_step_s=1.0)
    times = bh.measure({"slow": slow, "fast": fast, "compiles": compiles}, fake_clock, opt)
    assert times["slow"] == [7.0] and calls["slow"] == 2  # the second call's time, kept
    assert len(times["fast"]) >= 3 and all(t == 0.001 for t in times["fast"])
    assert len(times["compiles"]) >= 3 and all(t == 0.002 for t in times["compiles"])  # the compile not counted


def test_replot_remakes_the_markdown_from_the_csv(smoke_run, tmp_path):
    (csv_path,) = smoke_run.glob("bench_heads_smoke_*.csv")
    before = csv_path.read_bytes()
    assert bh.main(["--replot", str(csv_path), "--out", str(tmp_path)]) == 0
    assert csv_path.read_bytes() == before  # the source is read, not rewritten
    copy = tmp_path / csv_path.name
    assert copy.read_bytes() == before
    assert copy.with_suffix(".md").read_text() == csv_path.with_suffix(".md").read_text()
    assert copy.with_suffix(".png").stat().st_size > 0


def test_only_the_heads_that_score_every_class_are_guessed_too_slow_from_a_smaller_D():
    """A step at 10^4 classes scaled linearly to 2 x 10^7: fair for the full softmax and the
    naive head (their cost is linear in D), not for the hierarchical or sampled softmax."""
    import argparse

    from rich.console import Console

    runner = bh.Runner(argparse.Namespace(warmup=1, budget_s=1, min_steps=1, max_steps=1, max_step_s=2.0),
                       torch.device("cpu"), Console(quiet=True))
    runner.rows = [row(h, v, 30.0, device="cpu", D=10_000)
                   for h, v in (("softmax", "torch"), ("naive", "zloss"), ("hsoftmax", "sqrt_mass"),
                                ("sampled", "log_uniform"))]
    spec = {s.key: s for s in bh.HEADS}
    slow = {key: runner.too_slow(spec[key], torch.device("cpu"), 20_000_000, 512, 1024) for key in spec
            if key in {(r["head"], r["variant"]) for r in runner.rows}}
    assert slow[("softmax", "torch")].startswith("skipped: ~60 s/step") and slow[("naive", "zloss")]
    assert slow[("hsoftmax", "sqrt_mass")] is None and slow[("sampled", "log_uniform")] is None


def test_sizes_are_timed_targets_first_then_the_papers_size():
    """--deadline-s stops the run after a size: the target's d at every D comes first (the
    flatness pair's 2 x 10^7 included), then the paper's (793 471, 300) before the other D of
    d = 300 (so that a deadline does not cut the paper's size behind D = 10^4)."""
    order = bh.size_order([10_000, 793_471, 20_000_000], [512, 300])
    assert order == [(10_000, 512), (793_471, 512), (20_000_000, 512),
                     (793_471, 300), (10_000, 300), (20_000_000, 300)]
