"""The factored head's training step with no host synchronisation (``sync_every > 1``):
exact against the naive head, no read of a device value inside the step, and bad or
non-finite input still skipped, state untouched, and reported at the next read."""
import contextlib
import copy
import warnings

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead
from lst_lightning.spherical.collectives import bit_hash

from head_pairs import batch, make_pair, run_steps

D, d = 60, 8


def deferred(sync_every=4, **kw):
    args = dict(num_classes=D, hidden_dim=d, loss="zloss", loss_kwargs={"a": 0.5, "b": 2.0}, lr=0.05,
                bias=True, dtype=torch.float64, sync_every=sync_every)
    args.update(kw)
    return FactoredSphericalHead(**args)


def step(head, H, idx):
    """One training step on a copy of H; returns dL/dH."""
    Hc = H.clone().requires_grad_()
    head(Hc, idx).backward()
    return Hc.grad


def state(head):
    return bit_hash([head.V, head.U, head.Uinv, head.omega, head.Q, head.wbar, head.cond_bound])


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Any read of a tensor's value into Python (the host synchronisations on a GPU) raises."""
    def refuse(*_a, **_k):
        raise AssertionError("the step read a device value on the host")
    with monkeypatch.context() as mp:
        for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist"):
            mp.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("loss", ["zloss", "spherical_softmax", "mse"])
@pytest.mark.parametrize("m", [3, 16])  # Woodbury and direct solves
def test_deferred_step_is_exact(loss, m):
    torch.manual_seed(0)
    f, n = make_pair(loss, bias=True, lr=0.05, weight_decay=0.01)
    g = deferred(loss=loss, loss_kwargs=f.loss_fn.hparams(), weight_decay=0.01, sync_every=3)
    g.reset_weight(f.weight())
    run_steps(g, n, steps=40, m=m, K=3, tol=1e-9)
    assert int(g.steps) == 40 and int(g.skipped_nonfinite) == 0


def test_deferred_step_reads_nothing_on_the_host(monkeypatch):
    head = deferred(sync_every=10)
    batches = [batch(5, d, D, 3) for _ in range(9)]
    with no_host_reads(monkeypatch):
        for H, idx in batches:
            head(H.requires_grad_(), idx).backward()
    assert head._synced == (0, 0)  # not read yet
    H, idx = batch(5, d, D, 3)
    head(H.requires_grad_(), idx).backward()  # the 10th step reads the flags
    assert head._synced == (10, 0)


def test_sync_mode_reads_the_host(monkeypatch):
    """The test above can fail: the default head (sync_every=1) does read device values."""
    head = deferred(sync_every=1)
    H, idx = batch(5, d, D, 3)
    with no_host_reads(monkeypatch), pytest.raises(AssertionError, match="read a device value"):
        head(H.requires_grad_(), idx).backward()


def test_bad_target_is_skipped_then_reported():
    head = deferred(sync_every=3)
    H, idx = batch(5, d, D, 3)
    step(head, H, idx)
    before = state(head)
    bad = idx.clone()
    bad[2, 1] = D + 7
    grad = step(head, H, bad)  # no error yet: nothing is read inside the step
    assert state(head) == before and torch.equal(grad, torch.zeros_like(grad))
    with pytest.raises(ValueError, match=r"outside \[0, 60\)"):
        step(head, H, idx)  # the 3rd step reads the flag
    assert int(head.steps) == 2 and int(head.skipped_nonfinite) == 1
    step(head, H, idx)  # the flag was cleared
    assert int(head.steps) == 3


def test_non_finite_step_is_skipped_counted_and_warned():
    head = deferred(sync_every=2)
    H, idx = batch(5, d, D, 1)
    step(head, H, idx)
    before = state(head)
    H_bad = H.clone()
    H_bad[1, 3] = float("nan")
    with pytest.warns(RuntimeWarning, match="1 step"):
        step(head, H_bad, idx)
    assert state(head) == before
    assert (int(head.steps), int(head.skipped_nonfinite)) == (1, 1)


def test_repairs_fall_due_at_the_reads():
    """Periodic repairs still run when their step falls between two reads."""
    head = deferred(sync_every=3, stabiliser={"check_every": 5, "q_refresh_every": 7})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(15):
            H, idx = batch(4, d, D, 2)
            head(H.requires_grad_(), idx).backward()
    assert int(head.checks) >= 3 and int(head.q_refreshes) == 2  # steps 5, 10, 15; 7, 14
    W = head.weight()
    torch.testing.assert_close(head.Q, W.T @ W)


def test_naive_head_has_no_deferred_mode():
    n = NaiveSphericalHead(num_classes=D, hidden_dim=d)
    assert n.deferred_checks is False
    with pytest.raises(ValueError, match="sync_every"):
        deferred(sync_every=0)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_train_step_equals_forward_and_backward(sync_every):
    a = deferred(sync_every=sync_every, weight_decay=0.01)
    b = copy.deepcopy(a)
    for step in range(6):
        a.lr = b.lr = 0.05 / (1 + step)  # a schedule: the device lr follows
        H, idx = batch(5, d, D, 3)
        Ha = H.clone().requires_grad_()
        loss_a = a(Ha, idx)
        loss_a.backward()
        loss_b, dH_b = b.train_step(H.clone(), idx)
        assert torch.equal(loss_a.detach(), loss_b) and torch.equal(Ha.grad, dH_b)
    assert state(a) == state(b) and int(b.steps) == 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_step_equals_the_eager_step():
    from lst_lightning.spherical.graph_step import CudaGraphStep

    eager = deferred(sync_every=5, device="cuda", dtype=torch.float32)
    graphed = copy.deepcopy(eager)
    step = CudaGraphStep(graphed, m=16, K=2)
    assert state(graphed) == state(eager)  # warm-up and capture change nothing
    for i in range(12):
        eager.lr = graphed.lr = 0.05 / (1 + i)
        H, idx = batch(16, d, D, 2, dtype=torch.float32)
        H, idx = H.cuda(), idx.cuda()
        loss_e, dH_e = eager.train_step(H, idx)
        loss_g, dH_g = step(H, idx)
        torch.testing.assert_close(loss_g, loss_e)
        torch.testing.assert_close(dH_g, dH_e)
    torch.testing.assert_close(graphed.weight(), eager.weight())
    assert int(graphed.steps) == 12 and graphed._synced[0] == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_buffer_is_on_the_cuda_device():
    head = deferred(device="cuda")
    assert {b.device.type for b in head.buffers()} == {"cuda"}


def test_steps_at_zero_lr_change_no_bit():
    """The CUDA graph's warm-up runs real steps at lr 0: they must leave the head as it was."""
    from lst_lightning.spherical.graph_step import at_zero_lr

    head = deferred(sync_every=2, weight_decay=0.01)
    for _ in range(3):
        step(head, *batch(16, d, D, 2))  # U away from I; U^-1 stale (2m > d)
    before, counters = state(head), (int(head.steps), head._calls, head.lr)
    with at_zero_lr(head):
        for _ in range(3):
            head.train_step(*batch(16, d, D, 2))
    assert state(head) == before and (int(head.steps), head._calls, head.lr) == counters
    step(head, *batch(16, d, D, 2))  # and the lr is back
    assert state(head) != before


@pytest.mark.parametrize("how", ["autograd", "train_step"])
def test_decay_that_would_flip_w_is_refused_untouched(how):
    head = deferred(sync_every=1, weight_decay=0.5)
    head.lr = 2.0  # lr * weight_decay = 1
    H, idx = batch(4, d, D, 1)
    before = state(head)
    with pytest.raises(ValueError, match="the decay would flip W"):
        step(head, H, idx) if how == "autograd" else head.train_step(H, idx)
    assert state(head) == before and int(head.steps) == 0
