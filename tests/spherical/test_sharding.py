"""The multi-process factored head on two gloo processes (CPU) against one process
trained on the same global batches: replicated and sharded V, bit-identical
replicas, divergence detection, agreed input errors, sharded evaluation."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lst_lightning.heads import FactoredSphericalHead

WORLD, D, d, K, STEPS = 2, 50, 6, 3, 8
ROWS = [5, 3]  # ranks hold different numbers of rows


def make_head(mode, **kw):
    args = dict(num_classes=D, hidden_dim=d, loss="taylor_softmax", lr=0.05, weight_decay=0.01, bias=True,
                dtype=torch.float64, generator=torch.Generator().manual_seed(1), parallel=mode)
    args.update(kw)
    return FactoredSphericalHead(**args)


def global_batch(step):
    """Padding, a class repeated within a row and classes shared across rows (and ranks)."""
    g = torch.Generator().manual_seed(100 + step)
    M = sum(ROWS)
    H = torch.randn(M, d, generator=g, dtype=torch.float64)
    idx = torch.randint(0, D, (M, K), generator=g)
    idx[0, -1] = -1
    idx[1, 1] = idx[1, 0]
    idx[6, 0] = idx[0, 0]  # rank 1 shares a class with rank 0
    return H, idx


def eval_batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(sum(ROWS), d, generator=g, dtype=torch.float64), torch.randint(0, D, (sum(ROWS),), generator=g)


def train(head, rows):
    """STEPS steps on rows ``rows`` of each global batch: the gradients of H and the state."""
    grads = []
    for step in range(STEPS):
        H, idx = global_batch(step)
        Hr = H[rows].clone().requires_grad_()
        head(Hr, idx[rows]).backward()
        grads.append(Hr.grad)
    return grads


def evaluate(head, rows):
    H, t = eval_batch()
    head.eval()
    out = {"rank": head.target_rank(H[rows], t[rows]), "topk": head.topk(H[rows], 4),
           "log_prob": head.log_prob(H[rows], t[rows]), "loss": head(H[rows], t[rows])}
    head.train()
    return out


def worker(rank, rdv, out):
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    lo = sum(ROWS[:rank])
    rows = slice(lo, lo + ROWS[rank])
    res = {}
    for mode in ("replicated", "sharded", "sharded_sync_free"):
        head = make_head("sharded", sync_every=3) if mode == "sharded_sync_free" else make_head(mode)
        head.distribute()
        grads = train(head, rows)
        res[mode] = {"grads": grads, "W": head.weight(), "rows": (head.row_lo, head.row_hi),
                     "hash": head.state_hash(), "eval": evaluate(head, rows), "V": head.V.clone()}
    # A checkpoint with the whole V (gathered) loads into a fresh sharded head on each rank.
    full = [head.gather_v(dst=r) for r in range(WORLD)][rank]
    state = {**head.state_dict(), "V": full}
    fresh = make_head("sharded")
    fresh.distribute()
    fresh.load_state_dict(state)
    res["reloaded_equal"] = torch.equal(fresh.V, head.V) and fresh.state_hash() == head.state_hash()
    res["full_v"] = full
    # One rank's bad target: every rank raises, no rank's state changes.
    head = make_head("replicated")
    head.distribute()
    before = head.state_hash()
    H, idx = global_batch(0)
    idx = idx[rows].clone()
    if rank == 1:
        idx[0, 0] = D
    try:
        head(H[rows].clone().requires_grad_(), idx).backward()
        res["bad_input"] = None
    except ValueError as e:
        res["bad_input"] = str(e)
    res["bad_input_untouched"] = head.state_hash() == before
    # A replica that drifts by one bit is caught at the next checksum, on every rank.
    head = make_head("replicated", checksum_every=2)
    head.distribute()
    H, idx = global_batch(0)
    head(H[rows].clone().requires_grad_(), idx[rows]).backward()
    if rank == 1:
        head.U[0, 0] = torch.nextafter(head.U[0, 0], torch.tensor(math.inf, dtype=torch.float64))
    try:
        head(H[rows].clone().requires_grad_(), idx[rows]).backward()
        res["diverged"] = None
    except RuntimeError as e:
        res["diverged"] = str(e)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(worker, args=(str(tmp / "rdv"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single():
    """One process, the global batches."""
    head = make_head("none")
    all_rows = slice(0, sum(ROWS))
    grads = train(head, all_rows)
    return {"grads": grads, "W": head.weight(), "eval": evaluate(head, all_rows)}


def rel(a, b):
    return float((a - b).norm() / b.norm())


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


def test_replicas_are_bit_identical(ranks):
    assert ranks[0]["replicated"]["hash"] == ranks[1]["replicated"]["hash"]
    assert torch.equal(ranks[0]["replicated"]["W"], ranks[1]["replicated"]["W"])
    assert ranks[0]["sharded"]["hash"] == ranks[1]["sharded"]["hash"]  # U, Q, ... shared


def test_sharded_equals_replicated(ranks):
    assert [r["sharded"]["rows"] for r in ranks] == [(0, 25), (25, 50)]
    W = torch.cat([r["sharded"]["W"] for r in ranks])
    assert rel(W, ranks[0]["replicated"]["W"]) < 1e-12


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_evaluation_merges_shards(ranks, single, mode):
    ref = single["eval"]
    for r, res in enumerate(ranks):
        lo, hi = sum(ROWS[:r]), sum(ROWS[: r + 1])
        got = res[mode]["eval"]
        assert torch.equal(got["rank"], ref["rank"][lo:hi])
        assert torch.equal(got["topk"][1], ref["topk"][1][lo:hi])
        assert torch.allclose(got["topk"][0], ref["topk"][0][lo:hi], rtol=1e-12, atol=0)
        assert torch.allclose(got["log_prob"], ref["log_prob"][lo:hi], rtol=1e-12, atol=0)
    # the eval loss of each rank is the mean over its own rows
    H, t = eval_batch()
    head = make_head("none")
    train(head, slice(0, sum(ROWS)))
    head.eval()
    assert math.isclose(float(ranks[1][mode]["eval"]["loss"]), float(head(H[5:], t[5:])), rel_tol=1e-12)


def test_one_ranks_bad_input_raises_on_every_rank_and_changes_nothing(ranks):
    assert "outside [0, 50)" in ranks[1]["bad_input"]
    assert "another rank" in ranks[0]["bad_input"]
    assert all(r["bad_input_untouched"] for r in ranks)


def test_a_diverged_replica_fails_loudly_on_every_rank(ranks):
    for r in ranks:
        assert r["diverged"] is not None and "replicas diverged" in r["diverged"]


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


def test_topk_over_chunks_equals_full_topk():
    head = make_head("none")
    H = torch.randn(6, d, dtype=torch.float64)
    best, ids = head.topk(H, 7, chunk_size=8)  # chunks smaller than k
    want = head.scores(H).topk(7, dim=1)
    assert torch.equal(ids, want.indices)
    assert torch.allclose(best, want.values, rtol=1e-12, atol=0)  # GEMMs of other widths round apart


def test_gathered_v_is_whole_and_reloads_into_shards(ranks):
    whole = torch.cat([r["sharded_sync_free"]["V"] for r in ranks])  # the last head the worker built
    assert all(torch.equal(r["full_v"], whole) for r in ranks)
    assert all(r["reloaded_equal"] for r in ranks)
