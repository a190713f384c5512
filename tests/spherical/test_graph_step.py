"""The factored head's step replayed from a CUDA graph (graph_step.py), and its lr-0 warm-up."""
import copy

import pytest
import torch

from head_pairs import D, batch, d, deferred, state, step


@pytest.mark.gpu
def test_cuda_graph_step_equals_the_eager_step():
    from lst_lightning.spherical.graph_step import CudaGraphStep

    eager = deferred(sync_every=5, device="cuda", dtype=torch.float32)
    graphed = copy.deepcopy(eager)
    step = CudaGraphStep(graphed, m=16, K=2)
    assert state(graphed) == state(eager)  # warm-up and capture change nothing
    replays_as_eager(step, eager, graphed, [(16, 2)] * 12, lr=lambda i: 0.05 / (1 + i))
    assert int(graphed.steps) == 12 and graphed.step_checks.synced[0] == 10


def replays_as_eager(step, eager, graphed, shapes, lr=None):
    """Batches of ``shapes`` (m, K) through the graph and the eager head: the same losses, dL/dH and W."""
    for i, (m, K) in enumerate(shapes):
        if lr is not None:
            eager.lr = graphed.lr = lr(i)
        H, idx = batch(m, d, D, K, dtype=torch.float32)
        H, idx = H.cuda(), idx.cuda()
        loss_e, dH_e = eager.train_step(H, idx)
        loss_g, dH_g = step(H, idx)
        torch.testing.assert_close(loss_g, loss_e)
        torch.testing.assert_close(dH_g, dH_e)
    torch.testing.assert_close(graphed.weight(), eager.weight())



@pytest.mark.gpu
def test_one_graph_takes_every_batch_up_to_its_size_as_the_eager_step_does():
    """A graph captured for 32 rows of 4 slots replays batches of 1 to 32 rows and 1 to 3 slots,
    padded (batch_shapes.py): the loss, dL/dH (the batch's rows) and W are the eager step's."""
    from lst_lightning.spherical.graph_step import CudaGraphStep

    eager = deferred(sync_every=5, device="cuda", dtype=torch.float32)
    graphed = copy.deepcopy(eager)
    step = CudaGraphStep(graphed, m=32, K=4)
    replays_as_eager(step, eager, graphed, [(1, 1), (7, 3), (32, 2), (20, 1), (32, 3)])
    with pytest.raises(ValueError, match="at most 32 rows"):
        step(*batch(33, d, D, 1, dtype=torch.float32))


@pytest.mark.gpu
def test_thirty_batch_sizes_capture_a_graph_a_batch_size():
    """step="cuda_graph" on 30 random batch sizes (1 first, up to 100): a graph a batch size (16,
    32, 64, 128 rows), captured at its first batch, the head trained as the eager one."""
    from lst_lightning.spherical.batch_shapes import padded_rows

    eager = deferred(sync_every=8, device="cuda", dtype=torch.float64)
    graphed = copy.deepcopy(eager)
    eager.step, graphed.step = "fused", "cuda_graph"
    g = torch.Generator().manual_seed(0)
    sizes = [1] + torch.randint(1, 101, (29,), generator=g).tolist()
    for m in sizes:
        H, idx = batch(m, d, D, 2)
        for h in (eager, graphed):
            h(H.cuda().requires_grad_(), idx.cuda()).backward()
    assert sorted(graphed.graph_sizes) == sorted({(padded_rows(m, "pow2"), 2) for m in sizes})
    torch.testing.assert_close(graphed.weight(), eager.weight(), rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_every_buffer_is_on_the_cuda_device():
    head = deferred(device="cuda")
    assert {b.device.type for b in head.buffers()} == {"cuda"}



@pytest.mark.parametrize("inverse,dtype", [("auto", torch.float64), ("products", torch.float32)])
def test_steps_at_zero_lr_change_no_bit(inverse, dtype):
    """The CUDA graph's warm-up runs real steps at lr 0: they must leave the head as it was.
    "auto" on the CPU solves (2 m > d: U^-1 left stale); "products", the GPU's route, refines
    U^-1 by Newton-Schulz steps even at lr 0 (a graph captured again mid-run met this)."""
    from lst_lightning.spherical.graph_step import at_zero_lr

    head = deferred(sync_every=2, weight_decay=0.01, preconditioner={"beta": 0.9},  # its moments move at lr 0 too
                    stabiliser={"inverse": inverse}, dtype=dtype)
    for _ in range(3):
        step(head, *batch(16, d, D, 2, dtype=dtype))  # U away from I
    before, counters = state(head), (int(head.steps), head.step_checks.calls, head.lr)
    with at_zero_lr(head):
        for _ in range(3):
            head.train_step(*batch(16, d, D, 2, dtype=dtype))
    assert state(head) == before and (int(head.steps), head.step_checks.calls, head.lr) == counters
    step(head, *batch(16, d, D, 2, dtype=dtype))  # and the lr is back
    assert state(head) != before


def test_the_graph_step_uses_the_heads_public_api_only():
    """CudaGraphStep and its warm-up drive the head through public names (device_lr,
    pin_device_lr, count_replay, step_checks), never its private state."""
    import inspect
    import re

    from lst_lightning.spherical import graph_step

    source = inspect.getsource(graph_step)
    assert not re.findall(r"head\._[a-z]", source) and "lr_filled" not in source and "_version" not in source


def test_the_replayed_unit_is_the_fused_step_on_a_padded_batch():
    """What a CUDA graph captures (``replayed_step``: exact_step.py's device step run by the driver)
    takes a batch padded to the graph's rows, as CudaGraphStep fills it, to the fused step's
    loss, dL/dH and W (on the CPU: the unit, without the capture)."""
    from lst_lightning.spherical.graph_step import replayed_step

    eager = deferred(sync_every=4)
    graphed = copy.deepcopy(eager)
    M, K = 16, 3
    for m, k in [(11, 2), (16, 3), (5, 1), (9, 3), (16, 2), (3, 2)]:
        H, idx = batch(m, d, D, k)
        loss_e, dH_e = eager.train_step(H, idx)
        Hx, ids, T = graphed.prepare(H, idx, None, step=True)
        Hs, ids_s, Ts = Hx.new_zeros(M, graphed.width), ids.new_full((M, K), -1), T.new_zeros(M, K)
        Hs[:m], ids_s[:m, :k], Ts[:m, :k] = Hx, ids, T
        loss_g, dH_g = replayed_step(graphed, Hs, ids_s, Ts, torch.tensor(m), H.dtype)
        torch.testing.assert_close(loss_g, loss_e)
        torch.testing.assert_close(dH_g[:m], dH_e)
    graphed.sync()
    eager.sync()
    assert int(graphed.steps) == int(eager.steps) == 6
    torch.testing.assert_close(graphed.weight(), eager.weight())
