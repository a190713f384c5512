"""Multi-process training on CPU (gloo, two processes): two ranks train exactly like one
process on the same global batches, evaluate to the same metrics, keep the head's
buffers their own (DDP must not broadcast them), and a Hydra multirun of
multi-process jobs runs each job once.

The equivalence tests use ``ddp_fork``: the same launcher as ``trainer=ddp_cpu``'s
``ddp_spawn`` (workers started per trainer call, rank 0's state handed back) but without
re-importing torch in every worker, which costs ~30 s per trainer call on a loaded
2-core machine; each such run is called in a process of its own (forked_ranks.py's
``in_fresh_process``), whose ranks can fork whatever this worker compiled before. The multirun
test runs ``trainer=ddp_cpu`` as shipped (spawn)."""
import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from forked_ranks import free_port, in_fresh_process, start_ranks
from host_reads import by_file

from lst_lightning.app.callbacks.sparse_gradients import BYTES_KEY
from lst_lightning.app.train import run
from lst_lightning.data.datamodule import _PaddedIds
from lst_lightning.data.ngram import EpochBatchSampler
from lst_lightning.spherical.shard_files import load_rows

from app_configs import cfg_of, run_of

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # toy_heads, for subprocesses
B = 8  # per-rank batch; the one-process run uses 2B
# float64 and plain SGD (the sparse input embedding's rows too): the only difference left
# between the runs is the order of the sums (one batch of 2B rows, or two of B averaged by
# DDP). 101 evaluation examples: the second rank's last batch is padded.
COMMON = ["experiment=tiny", "logger=csv", "callbacks=minimal", "optimizer.name=sgd", "optimizer.lr=0.5",
          "optimizer.embedding=sparse_sgd",
          "trainer.precision=64-true", "trainer.limit_train_batches=6", "trainer.limit_test_batches=null",
          "data.max_eval_examples=101", "data.eval_batch_size=32", "metrics.timing_every=0", "model.dropout=0.0"]
TWO_RANKS = ["trainer=ddp_cpu", "trainer.strategy=ddp_fork", f"data.batch_size={B}"]
ONE_RANK = [f"data.batch_size={2 * B}"]


def state(run_dir):
    ckpt = torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {k: v for k, v in ckpt["state_dict"].items() if torch.is_tensor(v) and v.is_floating_point()}


def logged(run_dir, key) -> list[float]:
    """The values of ``key`` in a run's CSV log."""
    with (Path(run_dir) / "csv" / "metrics.csv").open(newline="") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key) not in (None, "")]


def assert_close_rel(a: dict, b: dict, skip=(), tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        if k in skip:
            continue
        err = (a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)
        assert err <= tol, f"{k}: relative error {err:.3g}"


def assert_metrics_equal(r1: dict, r2: dict, splits=("val", "test"), exact_only=False):
    for split in splits:
        a, b = r1[split], r2[split]
        assert a.keys() == b.keys()
        for k in a:
            if k.endswith("_error") or k == "mrr":  # from integer ranks: the same examples
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=0), (split, k)
            elif not exact_only:  # sums in another order
                assert a[k] == pytest.approx(b[k], rel=1e-5), (split, k)


# -- data: every rank gets the same batches of the one-process global batch -------------

@pytest.mark.parametrize("size", [103, 96, 97])
def test_train_shards_make_the_one_process_batch(size):
    one = list(EpochBatchSampler(size, 2 * B, seed=4, drop_last=True))
    ranks = [list(EpochBatchSampler(size, B, seed=4, drop_last=True, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(one)  # equal step counts: no rank waits forever
    for t, batch in enumerate(one):
        both = torch.cat([ranks[0][t], ranks[1][t]])
        assert sorted(both.tolist()) == sorted(batch.tolist())


@pytest.mark.parametrize("size,limit,world", [(101, None, 2), (1000, 101, 2), (10, None, 3), (64, None, 2)])
def test_eval_shards_are_equal_and_padded(size, limit, world):
    ranks = [list(EpochBatchSampler(size, 8, shuffle=False, rank=r, world_size=world, limit=limit))
             for r in range(world)]
    shapes = [[len(b) for b in r] for r in ranks]
    assert all(s == shapes[0] for s in shapes)  # same number of batches, same sizes
    ids = torch.cat([torch.cat(r) for r in ranks])
    real = ids[ids >= 0]
    assert len(real) == len(set(real.tolist())) == (limit or size)  # each example once
    assert (ids < 0).sum() == (-(limit or size)) % world  # only the padding needed


def test_padded_ids_give_target_minus_one():
    tokens = torch.arange(100)

    class Seq(torch.utils.data.Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, ids):
            return tokens[ids, None].repeat(1, 3), tokens[ids] + 1

    ctx, tgt = _PaddedIds(Seq())[torch.tensor([5, 7, -1])]
    assert tgt.tolist() == [6, 8, -1] and ctx.shape == (3, 3) and (ctx >= 0).all()


# -- the app: two ranks against one --------------------------------------------------------

class _ReportRanks(pl.Callback):
    """Each rank writes its head's buffers at the end of training."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        torch.save({k: v.clone() for k, v in pl_module.head.named_buffers()},
                   self.out / f"rank{trainer.global_rank}.pt")


#: the default suite runs torch's sparse gradients' exchange (static rows: test_fsdp2.py, -m slow here)
@pytest.mark.parametrize("head,embedding", [pytest.param("softmax", "sparse_sgd", marks=pytest.mark.slow),
                                           ("softmax", "sparse_adam"),
                                           pytest.param("softmax", "dense", marks=pytest.mark.slow),
                                           pytest.param("hsoftmax", "sparse_sgd", marks=pytest.mark.slow),
                                           pytest.param("hsoftmax", "row_adam", marks=pytest.mark.slow)])
def test_two_ranks_train_like_one_softmax(tmp_path, head, embedding):
    """An ordinary head: DDP averages its gradients with the body's; the input
    embedding's row-sparse ones are kept out of DDP and averaged by the app's all-gather
    exchange (callbacks.SparseGradients, the path NCCL takes too), which logs its bytes;
    so are the hierarchical softmax's row-sparse class rows (head.sparse=true), and static rows
    (row_adam: the hierarchical softmax's rows and the embedding's)."""
    over = [*(o for o in COMMON if not o.startswith("optimizer.embedding=")), f"head={head}",
            f"optimizer.embedding={embedding}", f"model.sparse_embedding={embedding != 'dense'}"]
    r2 = in_fresh_process(run_of, [*over, *TWO_RANKS], tmp_path / "two")
    r1 = run(cfg_of(*over, *ONE_RANK), tmp_path / "one")
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    assert r2["train_steps"] == r1["train_steps"] == 6
    s1, s2 = state(tmp_path / "one"), state(tmp_path / "two")
    assert_close_rel(s2, s1)
    assert any(k.startswith("head.") for k in s1) and any(k.startswith("body.") for k in s1)
    exchanged = logged(tmp_path / "two", BYTES_KEY)
    assert (min(exchanged) > 0) if embedding != "dense" else not exchanged, exchanged
    # and training moved them: the comparison is not of two initial states
    init = run(cfg_of(*over, *ONE_RANK, "trainer.max_steps=1", "test=false"), tmp_path / "init")
    assert init["train_steps"] == 1
    moved = state(tmp_path / "init")
    assert any((moved[k] - s1[k]).norm() > 1e-3 * s1[k].norm() for k in s1)
    assert_metrics_equal(r1, r2)
    assert r1["unigram_test"] == r2["unigram_test"]


def test_two_ranks_train_like_one_self_updating_head(tmp_path):
    """A self-updating head with a replicated mode: distribute() is called in setup,
    the replicas stay bit-identical, and DDP leaves the head's buffers alone (the
    rank_marker buffer differs between ranks on purpose and must stay so). On the
    synthetic data module (the others use the text one)."""
    over = [*COMMON, "head._target_=toy_heads.ToyReplicatedHead", "head.lr=0.05", "test=false", "data=synthetic",
            "~data.vocab_size", "data.num_classes=300", "data.input_vocab_size=100", "data.context_size=3"]
    out = tmp_path / "ranks"
    out.mkdir()
    r2 = in_fresh_process(run_of, [*over, *TWO_RANKS], tmp_path / "two", extra_callbacks=[_ReportRanks(out)])
    r1 = run(cfg_of(*over, *ONE_RANK), tmp_path / "one")
    assert r2["train_steps"] == r1["train_steps"] == 6
    assert_close_rel(state(tmp_path / "two"), state(tmp_path / "one"))
    b0, b1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert b0["rank_marker"] == 0 and b1["rank_marker"] == 1  # not broadcast from rank 0
    assert torch.equal(b0["weight"], b1["weight"])  # bit-identical replicas
    # The toy head's eval loss counts padding rows: compare the rank metrics only.
    assert_metrics_equal(r1, r2, splits=("val",), exact_only=True)


@pytest.mark.slow  # its ranks against one process: tests/baselines/test_preconditioned_rows_ranks.py
def test_two_ranks_hold_one_preconditioner_of_the_global_batch(tmp_path):
    """head=sampled_preconditioned through the whole app on two ranks: its moments are summed over
    the ranks' rows (an all-reduce in the head) and kept out of DDP's broadcast, so both ranks end
    with the same moments, moved by training; the rows' draws differ by rank, so the runs are not
    compared with one process here (tests/baselines/test_preconditioned_rows_ranks.py does that)."""
    over = [*(o for o in COMMON if not o.startswith("optimizer.")), "head=sampled_preconditioned", "test=false"]
    out = tmp_path / "ranks"
    out.mkdir()
    r2 = in_fresh_process(run_of, [*over, *TWO_RANKS], tmp_path / "two", extra_callbacks=[_ReportRanks(out)])
    assert r2["world_size"] == 2 and r2["train_steps"] == 6
    b0, b1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert float(b0["input_moment_weight"]) > 0 and b0["input_moment"].abs().sum() > 0
    assert torch.equal(b0["input_moment"], b1["input_moment"])
    assert torch.equal(b0["input_moment_weight"], b1["input_moment_weight"])


FACTORED = ["head=factored", "loss=zloss", "+head.dtype._target_=hydra.utils.get_object",
            "+head.dtype.path=torch.float64", "head.checksum_every=2"]


def _external_rank(rank: int, world: int, port: int, overrides: list, run_dir: str, callbacks_out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    run(cfg_of(*overrides), run_dir, extra_callbacks=[_ReportRanks(callbacks_out)] if callbacks_out else [])


def run_external(overrides: list, run_dir: Path, world: int = 2, callbacks_out: Path | None = None) -> dict:
    """What torchrun does: start the ranks with the rendezvous variables set and run the
    whole app on each (``strategy=ddp``: Lightning sees the environment and starts
    nothing); rank 0 writes the results."""
    over = [*overrides, "trainer=ddp_cpu", "trainer.strategy=ddp", f"trainer.devices={world}"]
    start_ranks(_external_rank, (world, free_port(), over, str(run_dir), callbacks_out), world)
    return json.loads((run_dir / "results.json").read_text())


#: the default suite: replicated here, sharded with accumulation below (-m slow: each both ways)
@pytest.mark.parametrize("parallel,launch", [("replicated", "fork"),
                                             pytest.param("sharded", "external", marks=pytest.mark.slow)])
def test_two_ranks_train_like_one_factored_head(tmp_path, parallel, launch):
    """The factored head through the whole app: W (materialised) and the body after
    two-rank training equal one-process training on the global batches; the evaluation
    (ranks merged across shards when sharded) gives the same metrics. The sharded head
    runs under an external launcher (spawned workers cannot hand a shard back)."""
    over = [*COMMON, *FACTORED, f"head.parallel={parallel}"]
    out = tmp_path / "ranks"
    out.mkdir()
    if launch == "fork":
        r2 = in_fresh_process(run_of, [*over, *TWO_RANKS], tmp_path / "two", extra_callbacks=[_ReportRanks(out)])
    else:
        r2 = run_external([*over, f"data.batch_size={B}"], tmp_path / "two", callbacks_out=out)
    r1 = run(cfg_of(*over, *ONE_RANK), tmp_path / "one")
    assert (r2["world_size"], r1["world_size"]) == (2, 1)
    assert r2["train_steps"] == r1["train_steps"] == 6
    s1, s2 = state(tmp_path / "one"), state(tmp_path / "two")
    body = lambda s: {k: v for k, v in s.items() if k.startswith("body.")}  # noqa: E731
    assert_close_rel(body(s2), body(s1))
    b0, b1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    if parallel == "replicated":
        assert all(torch.equal(b0[k], b1[k]) for k in b0)  # bit-identical replicas
    else:  # the shards split V; the rest is replicated bit for bit
        assert b0["V"].shape[0] + b1["V"].shape[0] == r1["num_classes"] and b1["V"].shape[0] > 0
        assert all(torch.equal(b0[k], b1[k]) for k in b0 if k != "V")
    if parallel == "sharded":  # the checkpoint gathers all of V
        saved = torch.load(tmp_path / "two" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]["head.V"]
        assert torch.equal(saved, torch.cat([b0["V"], b1["V"]]))
    assert_close_rel({"W": weight_of(tmp_path / "two", over)}, {"W": weight_of(tmp_path / "one", over)})
    assert_metrics_equal(r1, r2)


@pytest.mark.parametrize("parallel,launch", [pytest.param("replicated", "fork", marks=pytest.mark.slow),
                                             ("sharded", "external")])
def test_two_ranks_accumulating_train_like_one_factored_head(tmp_path, parallel, launch):
    """Gradient accumulation across processes: two ranks with micro-batches of B/2,
    accumulating 2 per optimizer step, take the steps of one process with 2B rows (one
    exact step of the head on the union of every rank's micro-batches; the sparse
    embedding's gradients accumulate on each rank and are averaged once per step)."""
    over = [*COMMON, *FACTORED, f"head.parallel={parallel}", "test=false"]
    two = [f"data.batch_size={B // 2}", "trainer.accumulate_grad_batches=2", "trainer.limit_train_batches=12"]
    if launch == "fork":
        r2 = in_fresh_process(run_of, [*over, *(o for o in TWO_RANKS if not o.startswith("data.batch_size=")), *two],
                              tmp_path / "two")
    else:
        r2 = run_external([*over, *two], tmp_path / "two")
    r1 = run(cfg_of(*over, *ONE_RANK), tmp_path / "one")
    assert (r2["world_size"], r1["world_size"]) == (2, 1)
    assert r2["train_steps"] == r1["train_steps"] == 6
    body = lambda s: {k: v for k, v in s.items() if k.startswith("body.")}  # noqa: E731
    assert_close_rel(body(state(tmp_path / "two")), body(state(tmp_path / "one")))
    assert_close_rel({"W": weight_of(tmp_path / "two", over)}, {"W": weight_of(tmp_path / "one", over)})
    assert_metrics_equal(r1, r2, splits=("val",))


class _CountReads(pl.Callback):
    """Each rank's host reads (``reads``, a HostReads entered around its run) by file from the
    end of its first optimizer step to the end of its last training batch (before the
    validation at the epoch's end), written at the end of training."""

    def __init__(self, reads, out: Path):
        self.reads, self.out, self.first, self.last = reads, out, None, None

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 1 and self.first is None:
            self.first = Counter(self.reads.sites)
        self.last = Counter(self.reads.sites)

    def on_train_end(self, trainer, pl_module):
        torch.save({"after": by_file(self.last - self.first), "steps": trainer.global_step},
                   self.out / f"reads{trainer.global_rank}.pt")


def _counting_rank(rank: int, world: int, port: int, overrides: list, run_dir: str, out: str) -> None:
    from host_reads import HostReads  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    with HostReads() as reads:
        run(cfg_of(*overrides), run_dir, extra_callbacks=[_CountReads(reads, Path(out))])


READ_STEPS = 64  # optimizer steps of the run whose host reads are counted (the flags read every 64)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["replicated", "sharded"])
def test_two_ranks_factored_head_reads_the_host_only_when_its_flags_are_read(tmp_path, parallel):
    """Lightning DDP on two ranks (as torchrun starts them), two micro-batches an optimizer step,
    64 steps, the factored head's default step (device flags): from the end of the first
    optimizer step (the head joins the process group, the ranks agree on the capacity of their
    rows) to the last training batch the head reads the host only at the reads of its flags
    (every 64 steps), in the repairs those run when they fell due, and in
    ``stats()`` when the app logs them. The sparse input embedding under ``row_adam`` (what
    ``optimizer.embedding=auto`` takes on a GPU) is averaged in fixed shapes: its exchange's fault
    rides on the head's read of its flags, in the same transfer (heads/flag_board.py). (The app's
    other reads are not the head's: the sampler's ids, host data, in the data module; the progress
    log.)"""
    over = [*COMMON, *FACTORED, "head.checksum_every=100", f"head.parallel={parallel}", "test=false",
            "optimizer.embedding=row_adam", "model.sparse_embedding=true", f"data.batch_size={B // 2}",
            "trainer.accumulate_grad_batches=2", f"trainer.limit_train_batches={2 * READ_STEPS}",
            "trainer=ddp_cpu", "trainer.strategy=ddp", "trainer.devices=2"]
    start_ranks(_counting_rank, (2, free_port(), over, str(tmp_path / "two"), str(tmp_path)))
    for rank in range(2):
        got = torch.load(tmp_path / f"reads{rank}.pt", weights_only=False)
        assert got["steps"] == READ_STEPS
        head = {f: n for f, n in got["after"].items() if f.startswith("src/lst_lightning/spherical/")}
        allowed = {f"src/lst_lightning/spherical/{f}.py" for f in ("stabiliser", "factored")}
        assert set(head) <= allowed, head
        board = got["after"].get("src/lst_lightning/heads/flag_board.py", 0)  # the head's flags, the embedding's
        assert 1 <= board and board / (READ_STEPS - 1) <= 0.1, got["after"]  # exchange's fault in the same transfer
        assert not any("exchange" in f for f in got["after"]), got["after"]  # no read of the exchange's own


def weight_of(run_dir, over):
    """The head's implicit W from a run's last checkpoint."""
    from lst_lightning.app.train import make_head  # noqa: PLC0415

    cfg = cfg_of(*over, "head.parallel=none")
    ckpt = torch.load(Path(run_dir) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    sd = {k[5:]: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}
    files = sd["_extra_state"].get("v_files")  # head_checkpoint=per_rank: V is in one file per rank
    D = load_rows(files).shape[0] if files else sd["V"].shape[0]  # the head reads its rows itself
    head = make_head(cfg, D, cfg.model.hidden_dim, torch.ones(D))
    head.load_state_dict(sd)
    return head.weight()


@pytest.mark.slow  # two-rank runs and their resumes (the default suite: test_resume.py's two ranks)
@pytest.mark.parametrize("head_checkpoint", ["whole", "per_rank"])
def test_sharded_checkpoint_resumes_on_any_number_of_ranks(tmp_path, head_checkpoint):
    """A 2-rank sharded run's checkpoint (V gathered whole, or one file per rank) resumes on
    one process and on two ranks, and both continue to the same head."""
    over = [*COMMON, *FACTORED, "head.parallel=sharded", "test=false", f"head_checkpoint={head_checkpoint}"]
    run_external([*over, f"data.batch_size={B}"], tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    if head_checkpoint == "per_rank":  # no V in the checkpoint; one file per rank beside it
        saved = torch.load(ckpt, weights_only=True)
        assert saved["state_dict"]["head.V"].numel() == 0
        files = saved["state_dict"]["head._extra_state"]["v_files"]
        assert sorted(p.name for p in Path(files).iterdir()) == ["rank00000.pt", "rank00001.pt"]
    more = ["trainer.max_epochs=2", f"ckpt_path={ckpt}"]
    r1 = run(cfg_of(*over, *ONE_RANK, *more), tmp_path / "b1")
    r2 = run_external([*over, f"data.batch_size={B}", *more], tmp_path / "b2")
    assert r1["train_steps"] == r2["train_steps"] == 12
    assert_close_rel({"W": weight_of(tmp_path / "b2", over)}, {"W": weight_of(tmp_path / "b1", over)})
    assert_metrics_equal(r1, r2, splits=("val",))


@pytest.mark.parametrize("head", ["naive", "toy_heads.ToySelfUpdatingHead"])
def test_self_updating_head_without_a_parallel_mode_is_refused(tmp_path, head):
    pick = f"head={head}" if "." not in head else f"head._target_={head}"
    with pytest.raises(ValueError, match="multi-process mode|parallel="):
        run(cfg_of(*COMMON, pick, *TWO_RANKS), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_sharded_head_under_spawned_workers_is_refused(tmp_path, strategy):
    with pytest.raises(ValueError, match="only rank 0's shard"):
        run(cfg_of(*COMMON, *FACTORED, "head.parallel=sharded", "trainer=ddp_cpu", f"trainer.strategy={strategy}"),
            tmp_path)
    assert not (tmp_path / "checkpoints").exists()


# -- Hydra multirun with multi-process jobs --------------------------------------------------

CLI = ["experiment=tiny", "logger=csv", "callbacks=minimal", "trainer.limit_train_batches=4",
       "data.max_eval_examples=64"]


def cli(*args, cwd, launcher=()):
    """``lst-train`` (or a launcher running it) in a subprocess; stdout + stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*launcher, *(() if launcher else (sys.executable,)), "-m", "lst_lightning.app.train", *args],
                          cwd=cwd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def sweep_results(sweep: Path) -> list[dict]:
    results = sorted(sweep.glob("*/results.json"))
    assert [p.parent.name for p in results] == ["0", "1"]
    out = []
    for p in results:
        r = json.loads(p.read_text())
        assert r["world_size"] == 2 and r["train_steps"] == 4 and 0 <= r["test"]["top5_error"] <= 1
        r["lr"] = yaml.safe_load((p.parent / "config.yaml").read_text())["optimizer"]["lr"]
        out.append(r)
    assert {r["lr"] for r in out} == {0.002, 0.004}
    return out


@pytest.mark.slow
def test_multirun_with_spawned_workers_runs_each_job_once(tmp_path):
    """``lst-train -m ... trainer=ddp_cpu``: the sweep's two jobs each train once with two
    processes and write their own results (no relaunch replays the sweep)."""
    sweep = tmp_path / "sweep"
    log = cli("-m", *CLI, "head=softmax", "trainer=ddp_cpu", "optimizer.lr=0.002,0.004",
              f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert log.count("Launching 2 jobs") == 1 and log.count("#1 : ") == 1, log[-3000:]
    sweep_results(sweep)
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    assert not (tmp_path / "multirun").exists()


@pytest.mark.slow
def test_multirun_with_plain_ddp_replays_the_sweep_on_every_rank(tmp_path):
    """What docs/multi_gpu.md warns about: Lightning starts rank 1 by re-running the
    command line, -m and all, so rank 1 launches the whole sweep again. With the basic
    launcher and a fixed sweep dir it walks the jobs in lockstep with rank 0 and the
    results come out right; anything that breaks the lockstep breaks the sweep."""
    sweep = tmp_path / "sweep"
    log = cli("-m", *CLI, "head=softmax", "trainer=ddp_cpu", "trainer.strategy=ddp", "optimizer.lr=0.002,0.004",
              f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert log.count("Launching 2 jobs") == 2, log[-3000:]  # once per rank: the replay
    sweep_results(sweep)
    assert (sweep / "0" / "train_ddp_process_1.log").exists()  # the replaying rank's job log


@pytest.mark.slow
def test_torchrun_runs_the_sharded_head(tmp_path):
    """The external launcher: torchrun starts both ranks, each runs lst-train with
    strategy=ddp (Lightning starts nothing), only rank 0 writes the run's files."""
    torchrun = Path(sys.executable).parent / "torchrun"
    run_dir = tmp_path / "run"
    cli(*CLI, "head=factored", "head.parallel=sharded", "trainer=ddp_cpu", "trainer.strategy=ddp",
        f"hydra.run.dir={run_dir}", cwd=tmp_path,
        launcher=(str(torchrun), "--standalone", "--nproc_per_node", "2"))
    r = json.loads((run_dir / "results.json").read_text())
    assert r["world_size"] == 2 and r["train_steps"] == 4 and 0 <= r["test"]["mrr"] <= 1
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
