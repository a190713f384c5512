"""lst-train with the body sharded by FSDP2 (``trainer=fsdp2_cpu``: Lightning's
ModelParallelStrategy, two gloo processes started as torchrun starts them) and the
factored head out of FSDP in its own multi-process mode: two ranks train like one process
on the same global batches; the body's parameters are DTensor shards and the sparse input
embedding stays whole on every rank (out of FSDP, averaged by the app's all-gather
exchange); a checkpoint resumes bit for bit. ModelParallelStrategy takes no float64
(Lightning: 32-true, bf16, 16-true): the runs are float32, the head float64."""
import csv
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from forked_ranks import free_port, start_ranks

from lst_lightning.app.train import run

from app_configs import cfg_of

B = 8  # per rank; the one-process run uses 2B
COMMON = ["experiment=tiny", "logger=csv", "callbacks=minimal", "optimizer.name=sgd", "optimizer.lr=0.5",
          "trainer.precision=32-true", "trainer.limit_train_batches=6", "trainer.limit_test_batches=null",
          "trainer.gradient_clip_val=0", "data.max_eval_examples=101", "data.eval_batch_size=32",
          "metrics.timing_every=0", "model.dropout=0.0", "head=factored", "loss=zloss", "head.checksum_every=2",
          "+head.dtype._target_=hydra.utils.get_object", "+head.dtype.path=torch.float64"]


class _ReportBody(pl.Callback):
    """Each rank writes what it holds of the body's parameters (type, local shape) at the end of training."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        held = {n: (type(p).__name__, tuple(getattr(p, "_local_tensor", p).shape))
                for n, p in pl_module.body.named_parameters()}
        torch.save(held, self.out / f"body{trainer.global_rank}.pt")


def _rank(rank: int, port: int, overrides: list, run_dir: str, report) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    run(cfg_of(*overrides), run_dir, extra_callbacks=[_ReportBody(report)] if report else [])


FSDP2 = ["trainer=fsdp2_cpu"]
DDP = ["trainer=ddp_cpu", "trainer.strategy=ddp"]


def two_ranks(overrides: list, run_dir: Path, report: Path | None = None, trainer=FSDP2) -> dict:
    """What torchrun does (the rendezvous variables set, the whole app on each rank)."""
    over = [*trainer, f"data.batch_size={B}", *overrides]
    start_ranks(_rank, (free_port(), over, str(run_dir), report))
    return json.loads((run_dir / "results.json").read_text())


def state(run_dir):
    ckpt = torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {k: v for k, v in ckpt["state_dict"].items() if torch.is_tensor(v) and v.is_floating_point()}


def model(s: dict) -> dict:
    """A checkpoint's body and the head's implicit W."""
    W = torch.addmm(s["head.omega"].double(), s["head.V"].double(), s["head.U"].double())
    return {**{k: v for k, v in s.items() if k.startswith("body.")}, "head.W": W}


def assert_close_rel(a: dict, b: dict, tol: float):
    assert a.keys() == b.keys()
    for k in a:
        err = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30))
        assert err <= tol, f"{k}: relative error {err:.3g}"


ACCUMULATING = [f"data.batch_size={B // 2}", "trainer.accumulate_grad_batches=2", "trainer.limit_train_batches=12"]
CLIPPING = ["trainer.gradient_clip_val=0.05"]  # small enough to clip every step


@pytest.mark.parametrize("parallel,two,embedding", [pytest.param("replicated", ACCUMULATING, "sparse_sgd",
                                                                 marks=pytest.mark.slow),
                                                    ("sharded", CLIPPING, "sparse_sgd"),
                                                    pytest.param("replicated", ACCUMULATING, "row_adam",
                                                                 marks=pytest.mark.slow)],
                         ids=["replicated-accumulating", "sharded-clipping", "row_adam-accumulating"])
def test_two_ranks_with_an_fsdp2_body_train_like_one(tmp_path, parallel, two, embedding):
    """With accumulation (two micro-batches of B/2 per rank and step: one exact head step on the
    world's four) and with gradient clipping (the norm over the body's shards and the whole
    sparse embedding's rows); the embedding's rows as torch's sparse gradients, or static rows
    (row_adam, what optimizer.embedding=auto takes on a GPU: averaged in fixed shapes)."""
    over = [*COMMON, f"optimizer.embedding={embedding}", *(o for o in two if o.startswith("trainer.gradient_clip"))]
    report = tmp_path / "report"
    report.mkdir()
    r2 = two_ranks([*over, f"head.parallel={parallel}", *two], tmp_path / "two", report)
    r1 = run(cfg_of(*over, f"data.batch_size={2 * B}"), tmp_path / "one")
    assert (r2["world_size"], r1["world_size"]) == (2, 1) and r2["train_steps"] == r1["train_steps"] == 6
    s1, s2 = state(tmp_path / "one"), state(tmp_path / "two")
    assert any(k.startswith("body.layers") for k in s1) and s1["head.V"].shape == s2["head.V"].shape
    # the body and the head's W = V U + 1 omega^T (its factors may differ by a fold, U^-1 by staleness):
    # float32 sums in another order; the checkpoint holds the whole body and V
    assert_close_rel(model(s2), model(s1), tol=2e-6)
    for r in range(2):  # what each rank held: shards of the body, the sparse embedding whole
        held = torch.load(report / f"body{r}.pt")
        assert held["input_embedding.weight"][0] == "Parameter" and held["input_embedding.weight"][1] == \
            tuple(s1["body.input_embedding.weight"].shape)
        dense = {n: h for n, h in held.items() if n != "input_embedding.weight"}
        assert dense and all(t == "DTensor" for t, _ in dense.values())
        assert sum(shape[0] for shape in [torch.load(report / f"body{q}.pt")["layers.0.weight"][1]
                                          for q in range(2)]) == s1["body.layers.0.weight"].shape[0]
    for split in ("val", "test"):
        assert r2[split]["mrr"] == pytest.approx(r1[split]["mrr"], rel=1e-5)
        assert r2[split]["loss"] == pytest.approx(r1[split]["loss"], rel=1e-5)


@pytest.mark.slow
def test_an_fsdp2_run_resumes_exactly(tmp_path):
    """Two epochs in one run, or one and a resume from its checkpoint: the same bits, with the
    sparse embedding's SparseAdam state (the optimizer's row-sparse part) and a sharded head."""
    over = [*COMMON, "head.parallel=sharded", "optimizer.embedding=sparse_adam", "test=false"]
    two_ranks([*over, "trainer.max_epochs=2"], tmp_path / "full")
    two_ranks([*over, "trainer.max_epochs=1"], tmp_path / "part")
    r = two_ranks([*over, "trainer.max_epochs=2", f"ckpt_path={tmp_path / 'part' / 'checkpoints' / 'last.ckpt'}"],
                  tmp_path / "resumed")
    assert r["train_steps"] == 12
    with (tmp_path / "resumed" / "csv" / "metrics.csv").open(newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert steps and min(steps) >= 6  # it resumed after the first epoch's 6 steps, not from the start
    a, b = state(tmp_path / "full"), state(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def optimizer_states(run_dir) -> list:
    return torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)["optimizer_states"]


def assert_states_close(a, b, tol: float):
    """Two optimiser states of the same format: the same keys and settings, tensors within ``tol``."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_states_close(a[k], b[k], tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_states_close(x, y, tol)
    elif torch.is_tensor(a):
        assert a.shape == b.shape and float((a.double() - b.double()).norm()) <= tol * max(float(b.double().norm()), 1.0)
    else:
        assert a == b


@pytest.mark.slow
def test_an_fsdp2_checkpoint_resumes_on_one_process_and_back(tmp_path):
    """A two-rank fsdp2 checkpoint (Adam on the body's shards, SparseAdam on the whole embedding, a
    sharded head) resumes in one process (with 2B) and under fsdp2 (two ranks) to the same model
    and the same optimiser state, saved in the same format; the one process's checkpoint resumes
    under fsdp2 as in one process."""
    over = [*COMMON, "optimizer.name=adam", "optimizer.lr=0.01", "optimizer.embedding=sparse_adam", "test=false"]
    sharded, one = [*over, "head.parallel=sharded"], [*over, f"data.batch_size={2 * B}"]
    two_ranks([*sharded, "trainer.max_epochs=1"], tmp_path / "part")
    more = ["trainer.max_epochs=2", f"ckpt_path={tmp_path / 'part' / 'checkpoints' / 'last.ckpt'}"]
    r2 = two_ranks([*sharded, *more], tmp_path / "two")
    r1 = run(cfg_of(*one, *more), tmp_path / "one")
    assert r1["train_steps"] == r2["train_steps"] == 12
    assert_close_rel(model(state(tmp_path / "two")), model(state(tmp_path / "one")), tol=1e-5)
    assert_states_close(optimizer_states(tmp_path / "two"), optimizer_states(tmp_path / "one"), tol=1e-5)
    back = ["trainer.max_epochs=3", f"ckpt_path={tmp_path / 'one' / 'checkpoints' / 'last.ckpt'}"]
    two_ranks([*sharded, *back], tmp_path / "two_back")
    run(cfg_of(*one, *back), tmp_path / "one_back")
    assert_close_rel(model(state(tmp_path / "two_back")), model(state(tmp_path / "one_back")), tol=1e-5)
    assert_states_close(optimizer_states(tmp_path / "two_back"), optimizer_states(tmp_path / "one_back"), tol=1e-5)


@pytest.mark.slow
def test_the_transformer_body_trains_under_fsdp2_and_ddp_like_one_process(tmp_path):
    """The GPT body (its blocks FSDP units of their own, the rest, position embedding included,
    in the body's unit): two ranks under fsdp2 and under DDP end where one process with 2B ends.
    data.sequence_length=B: each rank's batch of B tokens is one whole sequence, so the world's
    two sequences are the one-process batch of 2B tokens (a batch holds batch_size // length
    sequences, at least one: with B below the length each rank would still take a whole one)."""
    over = [*COMMON, "model=gpt", "test=false", f"data.sequence_length={B}"]
    two_ranks([*over, "head.parallel=replicated"], tmp_path / "fsdp2")
    two_ranks([*over, "head.parallel=replicated"], tmp_path / "ddp", trainer=DDP)
    run(cfg_of(*over, f"data.batch_size={2 * B}"), tmp_path / "one")
    a, b, one = state(tmp_path / "fsdp2"), state(tmp_path / "ddp"), state(tmp_path / "one")
    assert any(k.startswith("body.blocks.1.") for k in a)
    assert_close_rel(model(a), model(one), tol=2e-6)
    assert_close_rel(model(b), model(one), tol=2e-6)


@pytest.mark.slow
def test_the_lstm_body_trains_under_fsdp2_like_one_process(tmp_path):
    """The LSTM body (no module lists: one FSDP unit, the LSTM's weights DTensor halves between
    its forwards) with a sharded head: two ranks end where one process with 2B ends."""
    over = [*COMMON, "model=lstm", "test=false", "optimizer.embedding=sparse_sgd"]
    report = tmp_path / "report"
    report.mkdir()
    two_ranks([*over, "head.parallel=sharded"], tmp_path / "two", report)
    run(cfg_of(*over, f"data.batch_size={2 * B}"), tmp_path / "one")
    two, one = state(tmp_path / "two"), state(tmp_path / "one")
    assert_close_rel(model(two), model(one), tol=2e-6)
    held = [torch.load(report / f"body{r}.pt") for r in range(2)]
    assert all(h["lstm.weight_hh_l0"][0] == "DTensor" for h in held)
    assert sum(h["lstm.weight_hh_l0"][1][0] for h in held) == one["body.lstm.weight_hh_l0"].shape[0]
    assert held[0]["input_embedding.weight"][0] == "Parameter"  # the sparse embedding whole, out of FSDP
