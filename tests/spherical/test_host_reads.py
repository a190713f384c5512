"""No host read a step: the factored head's default step reads the device on the host only
when its flags are read, every ``sync_every`` steps (and in the repairs that fall due then):
at most 0.1 reads a step on each way a loop drives it. The counter (tests/helpers/host_reads.py)
fails on the host-checked step, which reads at every step."""
import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, driver

from host_reads import HostReads

D, d, m, K = 300, 8, 16, 3
STEPS = 128
MAX_READS_A_STEP = 0.1


def head(**kw):
    return FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=8), preconditioner={}, **kw)


def batch(ragged=False):
    """m rows of K slots (``ragged``: 1 to 2 m rows), a class repeated in a row."""
    rows = int(torch.randint(1, 2 * m + 1, ())) if ragged else m
    idx = torch.randint(-1, D, (rows, K))
    idx[0, 1] = idx[0, 0]
    return torch.randn(rows, d), idx


def autograd_steps(h, steps):
    for _ in range(steps):
        H, idx = batch(ragged=h.compile_step is True)
        h(H.requires_grad_(), idx).backward()


def fused_steps(h, steps):
    h.step = "fused"
    autograd_steps(h, steps)


def accumulated_steps(h, steps, micro=2):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    h.attach(opt, accumulate=micro)
    for _ in range(steps):
        autograd_steps(h, micro)
        opt.step()


ROUTES = {"autograd": autograd_steps, "fused": fused_steps, "accumulated": accumulated_steps}


@pytest.mark.parametrize("route", ROUTES)
def test_the_default_step_reads_the_host_at_most_once_in_ten_steps(route):
    torch.manual_seed(0)
    h = head()
    ROUTES[route](h, 2)  # the proposal's table made on the head's device, once
    with HostReads() as reads:
        ROUTES[route](h, STEPS)
    assert int(h.steps) == STEPS + 2
    assert reads.count / STEPS <= MAX_READS_A_STEP, reads.sites
    assert reads.count >= STEPS // h.sync_every  # the flags are read: one transfer each time


def test_the_host_checked_step_reads_at_every_step():
    """sync_every=1 reads each check as it is made: the counter sees it."""
    h = head(sync_every=1)
    autograd_steps(h, 2)
    with HostReads() as reads:
        autograd_steps(h, 8)
    assert reads.count >= 8 * 2, reads.sites


@pytest.mark.parametrize("route", ROUTES)
def test_batches_of_changing_size_padded_to_a_batch_size_read_the_host_no_more(route, monkeypatch):
    """The compiled step's padding (batch_shapes.py) on batches of 1 to 32 rows, its device parts
    run as they are (the counter follows Python, not a compiled graph's kernels): at most 0.1
    reads a step, as unpadded."""
    monkeypatch.setattr(driver, "compiled", lambda fn: fn)
    torch.manual_seed(0)
    h = head(compile_step=True)
    assert h.plan.compiled  # (compile_step=True: on the CPU too)
    ROUTES[route](h, 2)
    with HostReads() as reads:
        ROUTES[route](h, STEPS)
    assert int(h.steps) == STEPS + 2
    assert reads.count / STEPS <= MAX_READS_A_STEP, reads.sites


@pytest.mark.parametrize("route", ROUTES)
def test_a_step_asks_the_cuda_driver_nothing(route, monkeypatch):
    """Whether a CUDA graph is being captured is asked only where CUDA is initialized: under
    Lightning (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) each ``torch.cuda.is_available()`` loads NVML
    anew, about 0.1 ms on a machine without a driver."""
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda *a: calls.append(a) or False)
    torch.manual_seed(0)
    h = head()
    ROUTES[route](h, 2)
    calls.clear()
    ROUTES[route](h, 8)
    assert int(h.steps) == 10 and not calls
