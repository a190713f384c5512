"""The sampled softmax's preconditioner on two gloo processes (``SampledSoftmaxHead(preconditioner=)``):
every rank's moments and P are one process's on the union of the ranks' batches, and the rows'
gradients summed over the ranks (what DDP's all-reduce makes) are one process's on that union, step
after step of SGD, in float64. Unequal batches per rank, K = 2 targets with padding slots, a row with
no target and, at one step, a rank with none; a rank whose loss is not finite leaves every rank's
moments as they were; compiled whole (``fullgraph``), the head steps as eagerly."""
import os

import pytest
import torch
import torch.distributed as dist
from forked_ranks import start_ranks
from preconditioner_formula import p_of
from torch._dynamo.utils import counters

from lst_lightning.baselines import SampledSoftmaxHead

WORLD, D, d, K, STEPS, LR = 2, 17, 3, 2, 4, 0.3
ROWS = [5, 3]  # the ranks' rows of each global batch
BETA, DAMPING = 0.8, 0.1


def make_head():
    torch.manual_seed(0)
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, num_samples=5, bias=True, reduction="sum",
                              preconditioner={"beta": BETA, "damping": DAMPING}, dtype=torch.float64)
    torch.nn.init.normal_(head.bias)
    return head


def global_batch(step):
    """Padding slots, a row with no target (rank 1's first) and at step 2 no target on rank 1 at all."""
    g = torch.Generator().manual_seed(100 + step)
    H = torch.randn(sum(ROWS), d, generator=g, dtype=torch.float64)
    idx = torch.randint(0, D, (sum(ROWS), K), generator=g)
    idx[0, 1] = idx[7, 0] = -1
    idx[5] = -1
    if step == 2:
        idx[ROWS[0]:] = -1
    return H, idx


def train(head, rows, steps=STEPS, forward=None, summed=False):
    """SGD steps on rows ``rows`` of each global batch, the draws seeded alike (shared by the rows: every
    rank draws what one process draws); ``summed``: the rows' gradient summed over the ranks, as DDP's
    all-reduce makes it. Per step: the moments, P and the gradient of [W, b]."""
    forward = forward or head
    out = []
    for step in range(steps):
        H, idx = global_batch(step)
        torch.manual_seed(10 + step)
        head.zero_grad()
        forward(H[rows].clone().requires_grad_(), idx[rows]).backward()
        G = torch.cat([head.weight.grad, head.bias.grad[:, None]], 1)
        if summed:
            dist.all_reduce(G)
        with torch.no_grad():
            head.weight -= LR * G[:, :d]
            head.bias -= LR * G[:, d]
        S, w = head.input_moment.clone(), head.input_moment_weight.clone()
        out.append({"S": S, "w": w, "P": p_of(S, w, DAMPING), "G": G})
    return out


def rows_of(rank):
    """Rank ``rank``'s rows of each global batch."""
    return slice(sum(ROWS[:rank]), sum(ROWS[:rank + 1]))


def worker(rank, rdv, out):
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    rows = rows_of(rank)
    head = make_head()  # joins the default group at its first training forward
    res = {"steps": train(head, rows, summed=True), "world": head.pg.world}
    # rank 1's loss is not finite (an infinite row of W): no rank writes its moments
    before = head.input_moment.clone(), head.input_moment_weight.clone()
    H, idx = global_batch(STEPS)
    if rank == 1:
        with torch.no_grad():
            head.weight[idx[rows][1, 0]] = float("inf")
    try:
        head(H[rows].clone().requires_grad_(), idx[rows])
        res["raised"] = None
    except FloatingPointError as e:
        res["raised"] = str(e)
    res["kept"] = torch.equal(head.input_moment, before[0]) and torch.equal(head.input_moment_weight, before[1])
    # compiled whole (Dynamo and AOTAutograd, torch's own ops): the steps of the eager run
    compiled = make_head()
    compiled.distribute()
    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(compiled.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    res["compiled"] = train(compiled, rows, steps=2, forward=forward, summed=True)
    res["graphs"] = counters["stats"]["unique_graphs"]
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("preconditioned_ranks")
    start_ranks(worker, (str(out / "rdv"), str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single():
    """One process, every row of each global batch."""
    return train(make_head(), slice(None))


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_every_ranks_moments_and_P_are_one_process_on_the_union_of_the_batches(ranks, single):
    assert [r["world"] for r in ranks] == [WORLD] * WORLD
    for step, want in enumerate(single):
        got = [r["steps"][step] for r in ranks]
        assert torch.equal(got[0]["S"], got[1]["S"]) and torch.equal(got[0]["w"], got[1]["w"])  # the same bits
        assert rel(got[0]["S"], want["S"]) < 1e-12 and rel(got[0]["w"], want["w"]) < 1e-14
        assert rel(got[0]["P"], want["P"]) < 1e-12
    assert rel(single[-1]["P"], torch.eye(d + 1, dtype=torch.float64)) > 0.1  # P is not the identity


def test_the_rows_gradients_summed_over_the_ranks_are_one_process_on_the_union(ranks, single):
    """The gradient of [W, b] after the ranks' sum (DDP's all-reduce) is one process's on the union, so
    the SGD steps stay with it (the tables after each step are the same)."""
    for step, want in enumerate(single):
        for r in ranks:
            assert rel(r["steps"][step]["G"], want["G"]) < 1e-12


def test_a_rank_whose_loss_is_not_finite_leaves_every_ranks_moments(ranks):
    assert ranks[0]["raised"] is None and "non-finite loss" in ranks[1]["raised"]
    assert all(r["kept"] for r in ranks)


def test_compiled_whole_the_ranks_step_as_eagerly(ranks):
    for r in ranks:
        assert r["graphs"] > 0
        for got, want in zip(r["compiled"], r["steps"]):
            assert rel(got["S"], want["S"]) < 1e-12 and rel(got["G"], want["G"]) < 1e-12
