"""litgpt's GPT with the factored head on two gloo processes under a Fabric loop of litgpt's
shape: Fabric's DDP (float64) and the body sharded by FSDP2 (Fabric's ModelParallelStrategy,
float32: it takes no float64) with the head out of FSDP, against one process with the
world's batch, with gradient accumulation; checkpoints (V gathered) that resume on two processes
and on one, and one that holds a rank's shard refused on every rank; FSDP1 (Fabric's
FSDPStrategy) refused in one line."""
import pytest
from fabric_ranks import WORLD, B, STEPS, train, worker
from forked_ranks import fork_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return fork_ranks(worker, tmp_path_factory.mktemp("fabric_ranks"), WORLD)


@pytest.fixture(scope="module")
def one_process():
    return {"accumulated": train("ddp", "none", accumulate=2, batch=2 * B), "batch": train("ddp", "none", batch=2 * B, patch_first=True),
            "float32": train("float32", "none", accumulate=2, batch=2 * B)}


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def assert_same(got, ref, tol):
    """Every body parameter and the head's W within ``tol`` relative error (norms: sums in
    another order, a sharded head's partial sums all-reduced), the losses too."""
    assert got["body"].keys() == ref["body"].keys()
    worst = max(rel(got["body"][k], ref["body"][k]) for k in ref["body"])
    assert worst <= tol and rel(got["W"], ref["W"]) <= tol, (worst, rel(got["W"], ref["W"]))
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol)
    assert rel(ref["W"], ref["W_initial"]) > 1e3 * tol  # and training moved W: not two initial states


@pytest.mark.parametrize("case,ref", [("ddp_replicated", "accumulated"), ("ddp_sharded", "batch")])
def test_two_processes_under_fabric_ddp_train_like_one(ranks, one_process, case, ref):
    for r in range(WORLD):
        assert ranks[r][case]["steps"] == 3 and not ranks[r][case]["dtensor"]
        assert_same(ranks[r][case], one_process[ref], tol=1e-8)


def test_two_processes_with_an_fsdp2_body_train_like_one(ranks, one_process):
    for r in range(WORLD):
        got = ranks[r]["fsdp2_sharded"]
        assert got["steps"] == 3 and "transformer.h.0.attn.qkv.weight" in got["dtensor"]  # the body is sharded
        assert_same(got, one_process["float32"], tol=1e-5)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_is_refused_on_every_rank_before_any_step(ranks, use_orig_params):
    """Fabric's FSDPStrategy (FSDP1) wraps the model, head included: the first training forward
    says why and names FSDP2 and DDP, on both ranks, and the head has not changed."""
    for r in range(WORLD):
        got = ranks[r][f"fsdp1_orig_params_{use_orig_params}"]
        assert got["error"] is not None and "\n" not in got["error"]
        assert "cannot train under FSDP1" in got["error"] and "casts every buffer" in got["error"]
        assert "ModelParallelStrategy" in got["error"] and "DDP" in got["error"]
        assert got["steps"] == 0 and got["V_unchanged"]


def later(run: dict) -> dict:
    """A run of 2 x STEPS steps as its last STEPS steps show it (the losses after the checkpoint)."""
    return {**run, "losses": run["losses"][STEPS:]}


def test_a_two_process_checkpoint_with_v_gathered_resumes_on_two_processes_and_on_one(ranks):
    """Saved by fabric.save after 3 of 6 steps with the head sharded and gather_head_for_checkpoint:
    two processes (each keeps its rows) and one process with the world's batch end where the
    runs trained throughout end; Fabric's DDP (float64) and FSDP2 (float32, one-file checkpoints)."""
    out = ranks[0]["out"]
    for r in range(WORLD):
        for strategy, tol in [("ddp", 1e-10), ("fsdp2", 1e-6)]:
            assert ranks[r][f"{strategy}_resumed"]["steps"] == 2 * STEPS
            assert_same(ranks[r][f"{strategy}_resumed"], later(ranks[r][f"{strategy}_whole"]), tol=tol)
    for strategy, dtype_case, tol in [("ddp", "ddp", 1e-8), ("fsdp2", "float32", 1e-5)]:
        resumed = train(dtype_case, "none", batch=2 * B, steps=(STEPS, 2 * STEPS), load=out / f"{strategy}.ckpt")
        whole = train(dtype_case, "none", batch=2 * B, steps=(0, 2 * STEPS))
        assert resumed["steps"] == 2 * STEPS
        assert_same(resumed, later(whole), tol=tol)


def test_a_checkpoint_holding_one_ranks_shard_of_v_is_refused_on_every_rank(ranks):
    """Saved without gather_head_for_checkpoint, the file holds rank 0's rows of V: every rank
    (and one process) refuses it in one line naming the fix, before its head changes."""
    for r in range(WORLD):
        got = ranks[r]["ddp_shard_elsewhere"]
        assert got["error"] is not None and "\n" not in got["error"] and got["V_unchanged"]
        assert "rows 0:24 of V's 48" in got["error"] and "gather_head_for_checkpoint" in got["error"]
    assert ranks[0]["ddp_shard_elsewhere"]["error"].startswith("rank 1 cannot load this state")
    one = train("ddp", "none", batch=2 * B, steps=(STEPS, 2 * STEPS), load=ranks[0]["out"] / "shard.ckpt")
    assert one["V_unchanged"] and "this head holds rows 0:48" in one["error"]
