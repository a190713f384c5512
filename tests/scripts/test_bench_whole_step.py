"""scripts/bench_whole_step.py: the smoke run's outputs, the step it times (the app's
optimizers, a sparse embedding touching only its batch's rows), memory skips and the
target arithmetic."""
from __future__ import annotations

import csv

import bench_whole_step as bw
import results_pages as rp
import pytest
import torch


@pytest.mark.slow  # every head on both bodies, compiled
def test_smoke_run_writes_every_head_for_both_bodies(sandbox):
    # --all-losses-up-to 0: the factored head with the Z-loss and lst-train's default,
    # loss=sampled, at every D all the same (the default's bound at 10^6 needs the latter there)
    folder = sandbox.run_default(bw.main, ["--smoke", "--D", "50", "--heads", "softmax,hsoftmax,naive,factored",
                                           "--all-losses-up-to", "0"], "bench_whole_step")
    # (no D above 10k: no factored_at_10k pair)
    (path,) = folder.glob("whole_step_smoke_*.csv")
    with path.open() as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == [*bw.COLUMNS, "commit", "date"]
        rows = list(reader)
    assert {(r["body"], r["head"]) for r in rows} == {(b, h) for b in bw.DEFAULT_BODIES
                                                      for h in ("factored", "softmax", "hsoftmax", "naive")}
    assert {r["variant"] for r in rows if r["head"] == "factored"} == set(bw.EVERY_D_LOSSES)
    for r in rows:
        assert r["status"] == "ok" and float(r["median_ms"]) > 0 and int(r["steps"]) >= 2, r
        assert float(r["ratio"]) == pytest.approx(float(r["median_ms"]) / float(r["factored_ms"]), rel=1e-3)
        # the head's share: 1 - the body alone / the whole step, timed side by side
        assert 0 <= float(r["head_share"]) < 1 and float(r["body_ms"]) > 0, r
        assert float(r["head_share"]) == pytest.approx(max(0, 1 - float(r["body_ms"]) / float(r["median_ms"])),
                                                       abs=1e-3)
    assert sorted(p.suffix for p in folder.iterdir()) == [".csv", ".md", ".png"]
    assert "| check | value | status |" in path.with_suffix(".md").read_text()
    # every column is recordable: results_pages.py add drops the columns its tidy CSV lacks
    with (rp.DATA / "whole_step.csv").open() as fh:
        assert set(bw.COLUMNS) <= set(next(csv.reader(fh)))


@pytest.mark.parametrize("body", bw.DEFAULT_BODIES)
def test_a_step_moves_only_the_batch_rows_of_a_sparse_embedding(body):
    spec = next(s for s in bw.WHOLE_HEADS if s.key == ("softmax", "torch"))
    step = bw.WholeStep(body, spec, 300, sparse=True, smoke=True)
    emb = step.body.input_embedding.weight
    before, head_before = emb.detach().clone(), step.head.weight.detach().clone()
    x, _ = step.batches[0]
    step()
    moved = (emb.detach() != before).any(1).nonzero().flatten()
    assert set(moved.tolist()) == set(x.unique().tolist())
    assert not torch.equal(step.head.weight, head_before)  # the ordinary head is in an optimizer too
    # lst-train's optimizer.embedding=auto: SparseAdam where the step runs eager, RowAdam where it compiles
    assert step.optimizer_names == "Adam+SparseAdam"
    assert bw.app_optimizer_config(compiles=True)["embedding"] == "row_adam"


def test_memory_estimate_skips_what_does_not_fit(sandbox):
    folder = sandbox.run_default(bw.main, ["--smoke", "--D", "2000", "--bodies", "gpt", "--heads", "softmax",
                                           "--max-gb", "0.07"], "bench_whole_step")
    (path,) = folder.glob("whole_step_smoke_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert {r["head"] for r in rows} == {"factored", "softmax"}
    assert all(r["status"].startswith("skipped: ~") and "--max-gb" in r["status"] for r in rows), rows


def test_target_checks():
    def row(body, head, variant, D, ms, ratio=""):
        return dict(body=body, head=head, variant=variant, D=D, median_ms=ms, ratio=ratio, status="ok")

    rows = [row("gpt", "factored_at_10k", "zloss", 1_000_000, 10.0, 1 / 1.2),
            row("gpt", "factored_at_10k", "zloss", 10_000_000, 10.0, 1 / 3),
            row("gpt", "softmax", "torch", 793_471, 500.0, 50.0),
            row("gpt", "hsoftmax", "sqrt_mass", 793_471, 30.0, 3.0),
            row("gpt", "factored", "sampled", 1_000_000, 11.6, 1.16),
            row("gpt", "sampled", "log_uniform,sparse", 1_000_000, 8.0, 0.8)]
    got = {c["check"]: (c["status"], c["value"]) for c in bw.target_checks(rows)}
    assert got["gpt: D=1M, factored sampled step / row-sparse sampled softmax step <= 1.3x"] == ("FAIL", "1.45x")
    assert got["gpt: factored zloss step, D=1M / D=10k <= 1.3x"] == ("PASS", "1.2x; D=10,000,000: 3x")
    assert got["gpt: D=793,471, softmax step / factored zloss step >= 40x"] == ("PASS", "50x")
    assert got["gpt: D=793,471, hsoftmax step / factored zloss step >= 4x"] == ("FAIL", "3x")
    # on a GPU the default's step replayed from a CUDA graph (lst-train's head.step=auto) is the one checked
    graph = rows + [row("gpt", "factored_graph", "sampled", 1_000_000, 9.6, 0.96)]
    got = {c["check"]: (c["status"], c["value"]) for c in bw.target_checks(graph)}
    assert got["gpt: D=1M, factored sampled step / row-sparse sampled softmax step <= 1.3x"] == \
        ("PASS", "1.2x; the default's step from a CUDA graph")
    rows[0]["status"] = "skipped: ~9 GB"
    assert bw.target_checks(rows)[0]["status"] == "UNMEASURED"


def test_merge_keeps_only_what_the_new_run_does_not_measure():
    def row(head, D, ms):
        return {"body": "gpt", "head": head, "variant": "v", "D": str(D), "median_ms": ms}

    old = [row("softmax", 10, "1"), row("softmax", 99, "2"), row("factored", 99, "3")]
    new = [row("factored", 99, "4")]
    got = bw.merged(old, new)
    assert [(r["head"], r["D"], r["median_ms"]) for r in got] == [("softmax", "10", "1"), ("softmax", "99", "2"),
                                                                   ("factored", "99", "4")]


def test_flatness_pair_is_timed_side_by_side(sandbox, monkeypatch):
    monkeypatch.setitem(bw.TARGETS, "flat_lo", 40)  # the smoke sizes stand in for 10k and 1M
    monkeypatch.setitem(bw.TARGETS, "flat_hi", 90)
    folder = sandbox.run_default(bw.main, ["--smoke", "--D", "90", "--bodies", "ngram_mlp", "--heads", "factored/zloss"],
                                 "bench_whole_step")
    (path,) = folder.glob("whole_step_smoke_*.csv")
    rows = {r["head"]: r for r in csv.DictReader(path.open())}
    pair = rows["factored_at_10k"]
    assert pair["D"] == "90" and float(pair["ratio"]) == pytest.approx(
        float(pair["median_ms"]) / float(pair["factored_ms"]), rel=1e-3)
    assert "PASS" in path.with_suffix(".md").read_text() or "FAIL" in path.with_suffix(".md").read_text()


@pytest.mark.gpu
def test_smoke_run_on_the_gpu(sandbox):
    folder = sandbox.run_default(bw.main, ["--smoke", "--device", "cuda", "--D", "50,20000",
                                           "--heads", "softmax,hsoftmax,naive"], "bench_whole_step")
    (path,) = folder.glob("whole_step_smoke_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert {r["device"] for r in rows} == {"cuda"} and all(r["status"] == "ok" for r in rows), rows
    assert {r["head"] for r in rows} >= {"factored", "factored_at_10k", "softmax", "hsoftmax", "naive"}


@pytest.mark.parametrize("body", bw.BODIES)
def test_tokens_sets_the_targets_a_step(body):
    """--tokens: the batch of every model holds that many target tokens (n-gram windows, or
    gpt's sequences of SEQUENCE_LENGTH), and a count that is no multiple of it is refused."""
    spec = next(s for s in bw.WHOLE_HEADS if s.key == ("softmax", "torch"))
    step = bw.WholeStep(body, spec, 300, sparse=True, smoke=True, tokens=128)
    _, y = step.batches[0]
    assert y.numel() == 128


def test_another_batch_writes_files_of_its_own(sandbox):
    folder = sandbox.run_default(bw.main, ["--smoke", "--D", "60", "--bodies", "ngram_mlp", "--heads", "softmax",
                                           "--tokens", "64"], "bench_whole_step")
    (path,) = folder.glob("whole_step_smoke_tokens64_*.csv")
    rows = list(csv.DictReader(path.open()))
    assert rows and all(r["tokens"] == "64" for r in rows)


def test_tokens_must_fill_whole_sequences(capsys):
    with pytest.raises(SystemExit):
        bw.main(["--smoke", "--tokens", "100"])
    assert "--tokens must be a positive multiple of 32" in capsys.readouterr().err


@pytest.mark.slow  # a compile of a real-size transformer
def test_a_transformer_of_real_size_compiled_as_lst_train_compiles(sandbox, monkeypatch):
    """--bodies gpt_d1024 (its smoke widths) with --compile true: the body and the sampled softmax
    compiled (aot_eager here), the factored head its own step; every row has the head's share."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compile_(*a, **{**k, "mode": None, "backend": "aot_eager"}))
    folder = sandbox.run_default(bw.main, ["--smoke", "--D", "60", "--bodies", "gpt_d1024", "--heads",
                                           "sampled", "--compile", "true"], "bench_whole_step")
    (path,) = folder.glob("whole_step_smoke_compiled_*.csv")
    rows = {f"{r['head']}/{r['variant']}": r for r in csv.DictReader(path.open())}
    assert set(rows) == {"factored/zloss", "sampled/log_uniform", "sampled/log_uniform,sparse"}, set(rows)
    assert all(r["body"] == "gpt_d1024" for r in rows.values())
    for name in ("sampled/log_uniform", "sampled/log_uniform,sparse"):  # dense rows, and static rows under RowAdam
        assert rows[name]["compiled"] == "body and head (default mode)", rows[name]
    assert "RowAdam" in rows["sampled/log_uniform,sparse"]["optimizers"]
    assert rows["factored/zloss"]["compiled"] == "body (default mode)", rows["factored/zloss"]
    assert all(r["status"] == "ok" and r["head_share"] != "" for r in rows.values()), rows


def test_the_presets_of_real_size_are_what_their_names_say():
    for name, width, layers in (("gpt_d1024", 1024, 12), ("gpt_d2048", 2048, 24)):
        cfg = bw.model_config(name)
        assert (cfg["embed_dim"], cfg["hidden_dim"], cfg["num_layers"]) == (width, width, layers)
        assert cfg["embed_dim"] % cfg["num_heads"] == 0 and cfg["sparse_embedding"]
