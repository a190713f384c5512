"""Multi-process training of the factored head (multi_process.py) on two gloo processes:
equal to one process on the global batch, bit-identical replicas, sharded equals
replicated, agreed input errors, divergence caught, a gathered V reloads into shards."""

import pytest
import torch

from two_ranks import (CLIP_NORM, LONG_STEPS, LONG_SYNC_EVERY, NEGATIVE_MODES, RAGGED_STEPS, ROWS, STEPS, WORLD, D, d, make_head, negatives, rel,
                       train, train_long, train_ragged)

MAX_READS_A_STEP = 0.1


@pytest.fixture(scope="module")
def long_single():
    """One process on every row of the long run's batches, one step a batch or a step on the
    union of two (``micro``)."""
    out = {}
    for micro in (1, 2):
        head = make_head("none", sync_every=LONG_SYNC_EVERY)
        out[micro] = {"losses": train_long(head, micro=micro), "W": head.weight()}
    return out


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
def test_two_ranks_clip_the_global_batchs_gradient_as_one_process_does(ranks, single, mode):
    """``clip_norm``: the gradient scaled is the global batch's (the ranks' gathered rows), so two
    ranks step as one process on the global batch, and the bound mattered."""
    res, want = [r[f"clipped_{mode}"] for r in ranks], single["clipped"]
    W = torch.cat([r["W"] for r in res]) if mode == "sharded" else res[0]["W"]
    assert CLIP_NORM and rel(W, want["W"]) < 1e-12 and rel(W, single["negatives_shared=True"]["W"]) > 1e-3
    for r, got in enumerate(res):
        lo = sum(ROWS[:r])
        for step in range(STEPS):
            assert rel(got["grads"][step], WORLD * want["grads"][step][lo:lo + ROWS[r]]) < 1e-12


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
    # device flags: every rank voids the step and raises at the read, naming the step and the rank
    for r in ranks:
        assert "the batch of step 2 had target ids outside [0, 50) in rank 1's rows" in r["bad_input_deferred"]
        assert r["bad_input_deferred_untouched"]


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_the_default_step_on_two_ranks_reads_the_host_at_most_once_in_ten_steps(ranks, mode, micro):
    """Device flags: the ranks' rows padded to the capacity agreed at the first step (one read),
    the flags read every sync_every steps; batches of fewer rows (every 8th) pad. ``micro`` 2: exact
    accumulation, two batches an optimizer step."""
    for r in ranks:
        got = r[f"reads_{mode}_{micro}"]
        assert got["steps"] == LONG_STEPS
        assert got["reads"] / LONG_STEPS <= MAX_READS_A_STEP, got["sites"]
        assert got["reads"] >= LONG_STEPS // LONG_SYNC_EVERY, got["sites"]  # the flags are read: the counter sees them


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_two_ranks_padding_ragged_batches_equal_one_process_on_their_union(ranks, long_single, mode, micro):
    """The padded batch's loss and step are the one process's on the ranks' rows: padding rows
    add nothing, and the mean divides by the real rows."""
    res = [r[f"reads_{mode}_{micro}"] for r in ranks]
    want = long_single[micro]
    W = torch.cat([r["W"] for r in res]) if mode == "sharded" else res[0]["W"]
    assert rel(W, want["W"]) < 1e-12
    for got in res:
        assert rel(got["losses"], want["losses"]) < 1e-12


@pytest.mark.parametrize("key", ["compiled_ragged", "compiled_ragged_sync1"])
def test_two_ranks_compiled_take_batches_of_any_size_in_one_graph_a_part(ranks, key):
    """The compiled replicated default step (shared negatives, the preconditioner) on 30 batches whose every rank's rows change size (1 to 6):
    under device flags the ranks' rows are exchanged padded to one batch size (16 rows of 4 slots a
    rank: the capacity made a batch size, batch_shapes.py); with ``sync_every=1`` their exact rows
    are gathered and the union (2 to 12 rows) padded to a batch size (16). Either way the autograd
    step compiles its two parts once; W and the losses are one eager process's on the union of
    the rows."""
    want = make_head("none", **negatives(True))
    losses = train_ragged(want)
    for r in ranks:
        got = r[key]
        assert got["compiles"] and got["steps"] == RAGGED_STEPS and got["graphs"] <= 2, got["graphs"]
        assert rel(got["W"], want.weight()) < 1e-12 and rel(got["losses"], losses) < 1e-12


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_one_ranks_bad_shape_or_too_many_rows_raise_on_every_rank_at_the_next_read(ranks, mode):
    """After the first step no rank raises alone (the others would wait in the collective): the
    step is void on every rank and the next read raises on all of them, in one line, with that
    rank's message and the step; the step changed no state (the autograd step; replicated, the
    fused one too). ``head.rows_per_rank`` takes more rows."""
    shape = [r[f"void_{mode}_shape"] for r in ranks] + ([r["void_replicated_shape_fused"] for r in ranks]
                                                        if mode == "replicated" else [])
    rows = [r[f"void_{mode}_rows"] for r in ranks]
    for got in shape:
        assert got["error"].startswith("FactoredSphericalHead: the batch of step 4 was void on every rank: rank 1's "
                                       "input was invalid (ValueError: H has 7 columns but the head's hidden_dim is 6)")
    for got in rows:
        assert "the batch of step 4 was void on every rank: rank 1's input had 6 rows of 3 target slots, more than " \
               "the 5 rows of 3 slots the ranks agreed at their first training step" in got["error"]
        assert "head.rows_per_rank" in got["error"]
    for got in shape + rows:
        assert "\n" not in got["error"] and got["untouched"] and got["steps"] == 3
    assert len({got["error"] for got in shape}) == 1 and rows[0]["error"] == rows[1]["error"]
    for r in ranks:
        assert r[f"void_{mode}_rows_reserved"]["error"] is None and r[f"void_{mode}_rows_reserved"]["steps"] == 4


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_rows_per_rank_is_a_positive_int_or_none(value):
    head = make_head("replicated")
    with pytest.raises(ValueError, match="rows_per_rank must be a positive int or None"):
        head.rows_per_rank = value
    head.rows_per_rank = 8
    head.rows_per_rank = None


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
    from lst_lightning.spherical.multi_process import Replicated, Processes, ShardedRows
    from lst_lightning.spherical.stabiliser import Repairs

    own = [c for c in FactoredSphericalHead.__mro__ if c.__module__.startswith("lst_lightning.spherical")]
    assert len(own) <= 3, own  # the head, its sharded evaluation, the shell: the parts are objects
    alone = FactoredSphericalHead(D, d)
    assert type(alone.processes) is Processes and alone.processes.joined and isinstance(alone.repairs, Repairs)
    idx = torch.tensor([[3], [-1]])
    assert alone.processes.local_idx(idx) is idx and (alone.row_lo, alone.row_hi) == (0, D)
    sharded = FactoredSphericalHead(D, d, parallel="sharded")
    assert type(sharded.processes) is ShardedRows and not sharded.processes.joined and sharded.V.shape[0] == 0
    sharded.distribute()  # no process group: one rank holding every row
    assert sharded.processes.joined and (sharded.row_lo, sharded.row_hi) == (0, D) and sharded.V.shape[0] == D
    assert type(FactoredSphericalHead(D, d, parallel="replicated").processes) is Replicated
