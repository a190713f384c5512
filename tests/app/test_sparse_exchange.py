"""The all-gather average of row-sparse gradients (app/sparse_exchange.py) against two
obviously correct references, on two gloo processes: the dense gradients all-reduced and
divided by the world size, and gloo's own sparse all-reduce (what DDP used). Ragged
counts (rank 0 touches more rows than rank 1, or none), repeated rows within a rank and
rows shared by the ranks; the bytes received do not change between D = 10^4 and 10^6."""
import os

import pytest
import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from torch import nn

from lst_lightning.app.sparse_exchange import average_row_sparse, average_sparse_gradients
from lst_lightning.heads.flag_board import FlagBoard

WORLD, d = 2, 5
# rows each rank touches (repeats within a rank, rows shared across the ranks); the
# last case leaves rank 1 with no gradient at all (None)
CASES = [([3, 3, 7, 0, 9, 3, 12], [7, 1, 1]), ([5], [2, 4, 5, 6, 8, 11]), ([4, 0, 4], None)]


def sparse_grad(rows, D, rank, case):
    g = torch.Generator().manual_seed(10 * case + rank)
    vals = torch.randn(len(rows), d, generator=g, dtype=torch.float64)
    return torch.sparse_coo_tensor(torch.tensor(rows)[None], vals, (D, d))  # uncoalesced: repeats


def _worker(rank, rdv, out):
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    res = {"cases": [], "bytes": {}}
    for case, rows in enumerate(CASES):
        mine = rows[rank]
        D = 20
        grad = sparse_grad(mine, D, rank, case) if mine is not None else None
        dense = grad.to_dense() if grad is not None else torch.zeros(D, d, dtype=torch.float64)
        dist.all_reduce(dense)
        sparse_ref = (grad if grad is not None else torch.sparse_coo_tensor(
            torch.empty((1, 0), dtype=torch.int64), torch.empty(0, d, dtype=torch.float64), (D, d))).clone()
        dist.all_reduce(sparse_ref)  # gloo's sparse all-reduce: the sum
        p = nn.Parameter(torch.zeros(D, d, dtype=torch.float64))
        p.grad = grad
        received = average_sparse_gradients([p])
        res["cases"].append({"avg": p.grad, "dense_ref": dense / WORLD, "sparse_ref": sparse_ref.to_dense() / WORLD,
                             "received": received})
    for D in (10**4, 10**6):  # the same rows of a small and a large table
        _, res["bytes"][D] = average_row_sparse(sparse_grad(CASES[0][rank], D, rank, 0))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def results_of(worker, out):
    """``worker`` on WORLD gloo ranks (forked_ranks.py); each rank's saved results."""
    start_ranks(worker, (str(out / "rdv"), str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return results_of(_worker, tmp_path_factory.mktemp("exchange"))


def test_all_gather_average_equals_the_dense_all_reduce_and_gloos_sparse_one(two_ranks):
    for case in range(len(CASES)):
        for rank in range(WORLD):
            c = two_ranks[rank]["cases"][case]
            avg = c["avg"]
            assert avg.is_sparse and avg.is_coalesced()
            touched = {i for rows in CASES[case] if rows for i in rows}
            assert set(avg.indices()[0].tolist()) == touched  # only the rows some rank touched
            torch.testing.assert_close(avg.to_dense(), c["dense_ref"], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(avg.to_dense(), c["sparse_ref"], rtol=1e-12, atol=1e-12)
        # every rank ends with the same gradient, bit for bit
        assert torch.equal(two_ranks[0]["cases"][case]["avg"].to_dense(), two_ranks[1]["cases"][case]["avg"].to_dense())


def test_bytes_depend_on_the_rows_touched_not_on_D(two_ranks):
    for rank in range(WORLD):
        b = two_ranks[rank]["bytes"]
        print(f"rank {rank}: bytes received per step, D=10^4: {b[10**4]}, D=10^6: {b[10**6]}")
        # 7 and 3 entries (5 and 2 distinct rows): padded to 5 rows of d float64 and an int64 id each
        assert b[10**4] == b[10**6] == WORLD * (8 + 5 * (8 + d * 8))
    # the ranks with the larger and the smaller share receive the same padded buffers
    assert [c["received"] for c in two_ranks[0]["cases"]] == [c["received"] for c in two_ranks[1]["cases"]]


def test_one_process_returns_the_gradient_coalesced():
    grad = sparse_grad([3, 1, 3], 10, 0, 0)
    avg, received = average_row_sparse(grad)
    assert received == 0 and avg.is_coalesced()
    torch.testing.assert_close(avg.to_dense(), grad.to_dense())


@pytest.mark.parametrize("grad", [torch.zeros(4, 3), torch.zeros(4, 3).to_sparse(2)])
def test_a_gradient_that_is_not_row_sparse_is_refused(grad):
    with pytest.raises(ValueError, match="sparse_dim 1"):
        average_row_sparse(grad)


# static rows (RowGrad, optimizer.embedding=row_adam): each step's ids a rank gathers, -1 for
# padding (its gradient ignored), repeats within a rank and rows shared by the ranks, ragged counts
# (the capacity is the first step's larger), a rank with no gradient, then a rank over the capacity
STATIC_STEPS = [([3, 3, -1, 7, 0, 9, 3], [7, 1, -1]), ([5, 5], [2, 4, 5, 6]), ([4, 0, -1, 4], None),
                ([1, 2, 3, 4, 5, 6, 7, 8], [1])]


def _static_worker(rank, rdv, out):
    from host_reads import HostReads  # noqa: PLC0415

    from lst_lightning.rows import RowGrad  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    D = 20
    table = nn.Parameter(torch.zeros(D, d, dtype=torch.float64))
    rows = RowGrad(table)
    res = {"steps": [], "reads": [], "error": None}
    board = FlagBoard()  # the exchange's fault, read at the end
    for step, case in enumerate(STATIC_STEPS):
        mine = case[rank]
        rows.zero_grad()
        ids = torch.tensor(mine if mine is not None else [], dtype=torch.int64)
        g = torch.Generator().manual_seed(10 * step + rank)
        vals = torch.randn(len(ids), d, generator=g, dtype=torch.float64)
        if mine is not None:
            (rows.gather(table, ids) * vals).sum().backward()
        # the reference: the dense gradient (padding dropped) all-reduced and divided by the world size
        dense = torch.zeros(D, d, dtype=torch.float64).index_add_(0, ids[ids >= 0], vals[ids >= 0])
        dist.all_reduce(dense)
        with HostReads() as reads:
            received = average_sparse_gradients([table], step=step, board=board)
        uids, summed = rows.grad()
        got = torch.zeros(D, d, dtype=torch.float64).index_add_(0, uids[uids >= 0], summed[uids >= 0])
        assert uids[uids >= 0].unique().numel() == (uids >= 0).sum()  # each id once
        res["steps"].append({"got": got, "ref": dense / WORLD, "received": received})
        res["reads"].append(dict(reads.sites))
    try:
        board.read()
    except ValueError as e:
        res["error"] = str(e)
    # no board: a table's fault is read at the end of the call that had it
    other = nn.Parameter(torch.zeros(D, d, dtype=torch.float64))
    other_rows = RowGrad(other)
    for step, ids in enumerate(([1, 2], [1, 2, 3] if rank == 0 else [1])):  # rank 0 over the 2 agreed
        other_rows.zero_grad()
        other_rows.gather(other, torch.tensor(ids)).sum().backward()
        try:
            average_sparse_gradients([other], step=step)
        except ValueError as e:
            res["unboarded"] = (step, str(e))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks_static(tmp_path_factory):
    return results_of(_static_worker, tmp_path_factory.mktemp("static"))


def test_static_rows_average_equals_the_dense_all_reduce_with_no_host_read_after_the_first(two_ranks_static):
    """In fixed shapes: the average of every step up to the one over the capacity equals the dense
    reference; only the first exchange reads the host (the ranks agree on 7 rows, rank 0's first:
    its padding slot counts)."""
    for rank in range(WORLD):
        r = two_ranks_static[rank]
        for step in range(len(STATIC_STEPS) - 1):
            torch.testing.assert_close(r["steps"][step]["got"], r["steps"][step]["ref"], rtol=1e-12, atol=1e-12)
            assert r["steps"][step]["received"] == WORLD * (8 * 8 + 7 * d * 8)  # 7 ids + the count, 7 rows
        # the agreement: all_gather_ints's one transfer (.cpu(), then its tolist() on the host)
        assert {site.rsplit(":", 1)[0] for site in r["reads"][0]} == {
            "src/lst_lightning/distributed/collectives.py", "src/lst_lightning/app/sparse_exchange.py"}, r["reads"][0]
        assert all(not sites for sites in r["reads"][1:]), r["reads"]
    for step in range(len(STATIC_STEPS)):
        assert torch.equal(two_ranks_static[0]["steps"][step]["got"], two_ranks_static[1]["steps"][step]["got"])


def test_a_rank_over_the_static_capacity_leaves_the_rows_untouched_and_every_rank_raises(two_ranks_static):
    last = len(STATIC_STEPS) - 1  # rank 0 gathers 8 rows, one more than the 7 agreed
    for rank in range(WORLD):
        r = two_ranks_static[rank]
        assert not r["steps"][last]["got"].any()  # no row of either rank is stepped
        assert r["steps"][last]["ref"].any()  # though both ranks had some
        assert f"at step {last} a rank's batch gathered 8 rows, more than the 7" in r["error"]
        assert "\n" not in r["error"]
        step, error = r["unboarded"]  # without a board: raised by the call itself, on every rank
        assert step == 1 and "at step 1 a rank's batch gathered 3 rows, more than the 2" in error


def _head_board_worker(rank, rdv, out):
    """A factored head with deferred checks (``sync_every=4``) whose board carries a static-rows
    exchange's fault (as ``LanguageModel.flag_board`` gives it): rank 0 gathers more rows than the
    capacity at step 1; each step the head steps, then the rows are exchanged (the app's order)."""
    from lst_lightning.rows import RowGrad  # noqa: PLC0415
    from lst_lightning.spherical import FactoredSphericalHead  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    head = FactoredSphericalHead(12, d, loss="zloss", lr=0.05, dtype=torch.float64, sync_every=4)
    table = nn.Parameter(torch.zeros(20, d, dtype=torch.float64))
    rows, g = RowGrad(table), torch.Generator().manual_seed(rank)
    res = {"raised_at": None, "error": None}
    for step in range(8):
        try:
            head(torch.randn(6, d, generator=g, dtype=torch.float64).requires_grad_(),
                 torch.randint(0, 12, (6,), generator=g)).backward()  # every 4th step reads the head's board
        except ValueError as e:
            res["raised_at"], res["error"] = step, str(e)
            break
        rows.zero_grad()
        ids = torch.tensor([1, 2, 3, 4, 5] if (step, rank) == (1, 0) else [1, 2, 3])
        rows.gather(table, ids).sum().backward()
        average_sparse_gradients([table], step=step, board=head.flag_board)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_the_exchange_fault_rides_on_the_head_read_every_sync_every_steps(tmp_path):
    """The exchange's fault at step 1 raises at the head's read of step 3 (sync_every=4), not at
    the app's own interval of 64 steps, on both ranks, with the exchange's own message."""
    for r in results_of(_head_board_worker, tmp_path):
        assert r["raised_at"] == 3, r
        assert "at step 1 a rank's batch gathered 5 rows, more than the 3 the ranks agreed" in r["error"]
