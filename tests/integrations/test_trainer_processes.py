"""The HF Trainer on two gloo processes (DDP, as torchrun starts it) with the factored head
replicated or sharded: two processes with batch B train like one process with 2B (float64),
with gradient accumulation too; the Trainer's checkpoints resume exactly, and on one process; one rank's bad label
stops both ranks with its message; a head without a multi-process mode is refused."""
from collections import Counter

import pytest
import torch
from forked_ranks import fork_ranks
from host_reads import by_file
from trainer_ranks import LONG_STEPS, WORLD, long_worker, tiny_llama, train, worker

from lst_lightning.spherical.blocks import weight_of
from lst_lightning.spherical.state import POWER_STARTS

MODES = ["replicated", "sharded"]
MAX_READS_A_STEP = 0.1
FLAGS = "src/lst_lightning/heads/flag_board.py"  # the read of the device flags (driver.py's, on the head's board)
REPAIRS = "src/lst_lightning/spherical/stabiliser.py"  # the repairs a read runs when they fell due
#: what else reads after the first step: at the end of training, a sharded head's V gathered whole
#: (gather_v, one transfer a shard) for trainer.save_model()
AT_THE_END = {"replicated": set(), "sharded": {"src/lst_lightning/spherical/multi_process.py"}}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return fork_ranks(worker, tmp_path_factory.mktemp("trainer_ranks"), WORLD)


@pytest.fixture(scope="module")
def long_ranks(tmp_path_factory):
    return fork_ranks(long_worker, tmp_path_factory.mktemp("trainer_long"), WORLD)


def reads_after_the_first_step(got) -> Counter:
    """The package's host reads by file after the first optimizer step (in which the head joins
    the process group and the ranks agree on the capacity of their rows)."""
    return by_file(Counter(got["read_sites"]) - Counter(got["sites_first"]))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, batches of 2B (parallel='none': the head alone)."""
    out = tmp_path_factory.mktemp("one_process")
    return {"batch": train(out / "batch", "none", batch_size=4),
            "accumulated": train(out / "acc", "none", batch_size=4, accumulate=2, steps=6)}


def assert_same_model(a, b, rtol=1e-9, atol=1e-11):
    """Every parameter and buffer, but the power iterations' warm starts: U is near I after a few
    steps, its smallest singular values nearly equal, so the vector the iteration ends on is
    not determined by U to rounding (the condition estimate it gives is, and is compared)."""
    assert a.keys() == b.keys()
    starts = {f"lm_head.{n}" for n in POWER_STARTS}
    bad = [k for k in a if k not in starts and not torch.allclose(a[k].double(), b[k].double(), rtol=rtol, atol=atol)]
    assert not bad, f"differ: {bad}"


@pytest.mark.parametrize("parallel", MODES)
def test_two_processes_with_batch_b_train_like_one_with_2b(ranks, one_process, parallel):
    got, ref = ranks[0][f"{parallel}_batch"], one_process["batch"]
    assert int(got["state"]["lm_head.steps"]) == 3
    assert not torch.allclose(ref["state"]["lm_head.V"], tiny_llama().lm_head.weight)  # the head trained
    assert_same_model(got["state"], ref["state"])  # body and head, every buffer
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-9)  # the logged loss is the world's
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-9)  # Trainer.evaluate() on the ranks
    if parallel == "replicated":
        assert ranks[0][f"{parallel}_batch"]["hash"] == ranks[1][f"{parallel}_batch"]["hash"]  # bit-identical replicas
    else:
        assert ranks[0][f"{parallel}_batch"]["rows"] == (0, 48) and ranks[1][f"{parallel}_batch"]["rows"] == (48, 96)
        # trainer.save_model() after train() (rank 0 writes it) holds all of V, not rank 0's shard
        assert torch.equal(got["saved_v"], got["state"]["lm_head.V"]) and got["saved_v"].shape[0] == 96
        # and beside it the dense lm_head of all D classes, which from_pretrained loads
        state = got["state"]
        W = weight_of(state["lm_head.V"], state["lm_head.U"], state["lm_head.omega"])
        assert torch.equal(got["saved_weight"], W)


@pytest.mark.parametrize("parallel", MODES)
def test_two_processes_accumulating_train_like_one(ranks, one_process, parallel):
    """Two micro-batches of B per rank and optimizer step: one exact head step on the world's
    four micro-batches, the same model as one process accumulating two of 2B."""
    got, ref = ranks[0][f"{parallel}_accumulated"], one_process["accumulated"]
    assert int(got["state"]["lm_head.steps"]) == 6  # one head step per optimizer step
    assert_same_model(got["state"], ref["state"])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-9)


@pytest.mark.parametrize("parallel", MODES)
def test_two_processes_accumulating_read_the_host_only_when_the_flags_are_read(ranks, parallel):
    """Device flags under the Trainer on two processes, two micro-batches a step: after the first
    optimizer step no step reads the host (the ranks' rows padded to the capacity agreed in the
    first, their errors device flags); the flags are read once, at the end of training (6 steps,
    fewer than sync_every=32), with the repairs that fell due (and a sharded V gathered whole)."""
    for r in range(WORLD):
        got = ranks[r][f"{parallel}_reads"]
        assert int(got["state"]["lm_head.steps"]) == 6 and len(got["reads_by_step"]) == 6
        assert got["reads_by_step"][-1] == got["reads_first"], got["read_sites"]  # steps 2 to 6 read nothing
        after = reads_after_the_first_step(got)
        assert after[FLAGS] == 1 and set(after) <= {FLAGS, REPAIRS, *AT_THE_END[parallel]}, after


@pytest.mark.slow
@pytest.mark.parametrize("parallel", MODES)
def test_two_processes_accumulating_read_the_host_at_most_once_in_ten_optimizer_steps(long_ranks, parallel):
    """64 optimizer steps of two micro-batches on two processes: after the first, the package
    reads the host at the reads of the flags (every 64 steps and at the end of training), at
    most once in ten steps, and in what they run: the repairs those reads run when they fell due
    (on this toy, lr 0.5 at D = 96, cond(U)'s bound passes cond_trigger by every read; a repair
    reads U's extreme singular values before and after its fixes: two reads)."""
    for r in range(WORLD):
        got = long_ranks[r][parallel]
        assert int(got["state"]["lm_head.steps"]) == LONG_STEPS
        after = reads_after_the_first_step(got)
        assert set(after) <= {FLAGS, REPAIRS, *AT_THE_END[parallel]}, after
        assert after[FLAGS] / (LONG_STEPS - 1) <= MAX_READS_A_STEP, after


def test_counting_tokens_per_process_trains_the_same_model(ranks, one_process):
    """average_tokens_across_devices=False: each rank's count is its own; the head sums them."""
    assert_same_model(ranks[0]["tokens_per_process"]["state"], one_process["accumulated"]["state"])


@pytest.mark.parametrize("parallel", MODES)
def test_a_two_process_trainer_checkpoint_resumes_exactly(ranks, parallel):
    whole, resumed = ranks[0][f"{parallel}_accumulated"], ranks[0][f"{parallel}_resumed"]
    assert int(resumed["state"]["lm_head.steps"]) == 6
    assert_same_model(resumed["state"], whole["state"], rtol=0, atol=0)  # bit for bit


@pytest.mark.parametrize("parallel", MODES)
def test_a_two_process_trainer_checkpoint_resumes_on_one_process(ranks, one_process, parallel, tmp_path):
    """The checkpoint after 3 of 6 steps (V whole: a sharded head's gathered on rank 0) resumed
    by one process with the world's batch ends where one process trained throughout ends."""
    ckpt = ranks[0]["out"] / f"{parallel}_acc" / "checkpoint-3"
    got = train(tmp_path / "one", "none", batch_size=4, accumulate=2, steps=6, resume=str(ckpt))
    assert got["steps_at_start"] == 3 and int(got["state"]["lm_head.steps"]) == 6  # it resumed at step 3
    assert_same_model(got["state"], one_process["accumulated"]["state"])


def test_one_ranks_bad_label_stops_every_rank_with_its_message(ranks):
    """Device flags: every step with the bad label is void on every rank, and the read of the
    flags at the end of training raises on every rank, naming the first such step."""
    for r in range(WORLD):
        res = ranks[r]["bad_label"]
        assert "the batch of step 1 had target ids outside" in res["error"] and res["steps"] == 0, res["error"]
    assert ranks[0]["bad_label"]["hash"] == ranks[1]["bad_label"]["hash"]  # no rank changed state


def test_a_head_without_a_parallel_mode_is_refused_on_two_processes(ranks):
    for r in range(WORLD):
        res = ranks[r]["no_parallel_mode"]
        assert "parallel='none' but 2 processes" in res["error"] and "parallel='replicated'" in res["error"]
        assert res["steps"] == 0


@pytest.mark.parametrize("parallel", MODES)
def test_two_process_logits_and_export_are_the_whole_heads(ranks, one_process, parallel):
    """In eval mode the logits cover all D classes (a sharded head gathers every rank's), and
    export_dense_head gives every rank the whole W, as one process has them."""
    ref = one_process["batch"]
    for r in range(WORLD):
        got = ranks[r][f"{parallel}_batch"]
        assert got["logits"].shape == ref["logits"].shape == (1, 10, 96)
        assert torch.allclose(got["logits"], ref["logits"], rtol=1e-9, atol=1e-11)
        assert torch.allclose(got["exported"], ref["exported"], rtol=1e-9, atol=1e-11)


def test_ddp_leaves_the_patched_heads_buffers_alone_until_export():
    """DDP reads _ddp_params_and_buffers_to_ignore when it wraps the model; names listed
    before stay listed, and export_dense_head takes the head's names back out."""
    from lst_lightning.integrations import export_dense_head, factor_lm_head

    model = tiny_llama()
    model._ddp_params_and_buffers_to_ignore = ["model.norm.weight"]
    factor_lm_head(model, parallel="replicated")
    names = {f"lm_head.{n}" for n, _ in model.lm_head.named_buffers()}
    assert {"lm_head.V", "lm_head.U", "lm_head.Q"} <= names
    assert set(model._ddp_params_and_buffers_to_ignore) == names | {"model.norm.weight"}
    export_dense_head(model)
    assert model._ddp_params_and_buffers_to_ignore == ["model.norm.weight"]



@pytest.mark.parametrize("strategy", ["FSDP", "DEEPSPEED", "MEGATRON_LM"])
def test_a_strategy_that_shards_the_model_is_refused_in_one_line(strategy):
    """What head_follows_trainer checks when the Trainer is built (on_init_end), before any step.
    (On CPU accelerate runs no FSDP: TrainingArguments(fsdp=True) trains with DDP there.)"""
    from accelerate.utils import DistributedType

    from lst_lightning.integrations.processes import check_strategy

    with pytest.raises(ValueError, match=rf"cannot train under {strategy}: .*parallel='sharded'") as e:
        check_strategy(DistributedType[strategy])
    assert "\n" not in str(e.value)
    for fine in ("NO", "MULTI_CPU", "MULTI_GPU"):
        check_strategy(DistributedType[fine])
