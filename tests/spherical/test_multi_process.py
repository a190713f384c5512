"""Multi-process training of the factored head (multi_process.py) on two gloo processes:
equal to one process on the global batch, bit-identical replicas, sharded equals
replicated, agreed input errors, divergence caught, a gathered V reloads into shards."""

import pytest
import torch

from two_ranks import NEGATIVE_MODES, ROWS, STEPS, WORLD, D, d, make_head, rel, train


@pytest.mark.parametrize("mode", ["replicated", "sharded", "sharded_sync_free"])
def test_two_ranks_equal_one_process_on_the_global_batch(ranks, single, mode):
    W = torch.cat([r[mode]["W"] for r in ranks]) if mode.startswith("sharded") else ranks[0][mode]["W"]
    assert W.shape == (D, d + 1)
    assert rel(W, single["W"]) < 1e-12
    for step in range(STEPS):
        for r, res in enumerate(ranks):
            lo = sum(ROWS[:r])
            want = WORLD * single["grads"][step][lo:lo + ROWS[r]]  # DDP then averages over ranks
            assert rel(res[mode]["grads"][step], want) < 1e-12


@pytest.mark.parametrize("name", sorted(NEGATIVE_MODES))
def test_two_ranks_with_negatives_equal_one_process_on_the_global_batch(ranks, single, name):
    """loss=sampled: each rank draws the same negatives from the head's seed, so the step on
    the world's rows is the one process's on the global batch; sharded, the block's rows of
    V are all-reduced once and each rank scatters into its own. Negatives drawn per row: the
    ranks' rows padded to the largest rank's (device flags, padded_rows.py) draw as the one
    process on the padded batches does (their draw is of the padded rows)."""
    mode, shared = NEGATIVE_MODES[name]
    want = single[f"negatives_shared={shared}" if shared else "negatives_per_padded_row"]
    res = [r[name] for r in ranks]
    W = torch.cat([r["W"] for r in res]) if mode == "sharded" else res[0]["W"]
    assert rel(W, want["W"]) < 1e-12 and rel(W, single["W"]) > 1e-3  # the negatives mattered
    for r, got in enumerate(res):
        lo = sum(ROWS[:r]) if shared else r * max(ROWS)
        for step in range(STEPS):
            assert rel(got["grads"][step], WORLD * want["grads"][step][lo:lo + ROWS[r]]) < 1e-12
    assert res[0]["hash"] == res[1]["hash"]


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_accumulation_across_two_ranks_is_one_step_on_every_ranks_micro_batches(ranks, single, mode):
    """Attached to the optimizer (gradient accumulation), each rank keeps the gathered rows
    of its micro-batches and the optimizer's step applies one exact step on all of them:
    one process stepping once per union of the global batches."""
    res = [r[f"accumulated_{mode}"] for r in ranks]
    W = torch.cat([r["W"] for r in res]) if mode == "sharded" else res[0]["W"]
    assert rel(W, single["W_unions"]) < 1e-12
    assert rel(W, single["W"]) > 1e-6  # not the trajectory of one step per global batch
    assert res[0]["hash"] == res[1]["hash"]


def test_replicas_are_bit_identical(ranks):
    assert ranks[0]["replicated"]["hash"] == ranks[1]["replicated"]["hash"]
    assert torch.equal(ranks[0]["replicated"]["W"], ranks[1]["replicated"]["W"])
    assert ranks[0]["sharded"]["hash"] == ranks[1]["sharded"]["hash"]  # U, Q, ... shared


def test_sharded_equals_replicated(ranks):
    assert [r["sharded"]["rows"] for r in ranks] == [(0, 25), (25, 50)]
    W = torch.cat([r["sharded"]["W"] for r in ranks])
    assert rel(W, ranks[0]["replicated"]["W"]) < 1e-12




def test_one_ranks_bad_input_raises_on_every_rank_and_changes_nothing(ranks):
    assert "outside [0, 50)" in ranks[1]["bad_input"]
    assert "rank 1's input to the head was invalid (ValueError:" in ranks[0]["bad_input"]
    assert "outside [0, 50)" in ranks[0]["bad_input"]  # the message of the rank that saw it
    assert all(r["bad_input_untouched"] for r in ranks)
    # device flags: every rank voids the step and raises at the read, naming the step
    for r in ranks:
        assert "the batch of step 2 had target ids outside [0, 50)" in r["bad_input_deferred"]
        assert r["bad_input_deferred_untouched"]


def test_a_diverged_replica_fails_loudly_on_every_rank(ranks):
    for r in ranks:
        for key in ("diverged", "diverged_deferred"):
            assert r[key] is not None and "replicas diverged" in r[key], key


def test_sharded_head_alone_is_the_whole_head():
    """Without a process group a sharded head holds every row and trains as one process."""
    a, b = make_head("sharded"), make_head("none")
    assert a.V.shape[0] == 0  # nothing is allocated before distribute()
    train(a, slice(0, 8))
    train(b, slice(0, 8))
    assert (a.row_lo, a.row_hi) == (0, D)
    assert torch.equal(a.weight(), b.weight())


def test_initial_rows_do_not_depend_on_the_split():
    head = make_head("none", num_classes=200_000, hidden_dim=2)
    assert torch.equal(head._init_rows(65_000, 140_000), head.V[65_000:140_000])




def test_gathered_v_is_whole_and_reloads_into_shards(ranks):
    whole = torch.cat([r["sharded_sync_free"]["V"] for r in ranks])  # the last head the worker built
    assert all(torch.equal(r["full_v"], whole) for r in ranks)
    assert all(r["reloaded_equal"] for r in ranks)


def test_the_head_is_made_of_parts_not_mixins():
    """The process-group work, the repairs and the checks are objects the head holds: one
    process is the identity sharding, a multi-process head starts alone until distribute()."""
    from lst_lightning.spherical import FactoredSphericalHead
    from lst_lightning.spherical.multi_process import Replicated, Sharding, ShardedRows
    from lst_lightning.spherical.stabiliser import Repairs

    own = [c for c in FactoredSphericalHead.__mro__ if c.__module__.startswith("lst_lightning.spherical")]
    assert len(own) <= 3, own  # the head, its sharded evaluation, the shell: the parts are objects
    alone = FactoredSphericalHead(D, d)
    assert type(alone.sharding) is Sharding and alone.sharding.joined and isinstance(alone.repairs, Repairs)
    idx = torch.tensor([[3], [-1]])
    assert alone.sharding.local_idx(idx) is idx and (alone.row_lo, alone.row_hi) == (0, D)
    sharded = FactoredSphericalHead(D, d, parallel="sharded")
    assert type(sharded.sharding) is ShardedRows and not sharded.sharding.joined and sharded.V.shape[0] == 0
    sharded.distribute()  # no process group: one rank holding every row
    assert sharded.sharding.joined and (sharded.row_lo, sharded.row_hi) == (0, D) and sharded.V.shape[0] == D
    assert type(FactoredSphericalHead(D, d, parallel="replicated").sharding) is Replicated
