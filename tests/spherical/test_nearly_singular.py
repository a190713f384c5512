"""Steps whose B = c (I - A) is nearly singular, on purpose: every loss stays equal to the
explicit-W reference with host checks and with device flags, eager and compiled. Under device
flags such a step is folded into V within its own step, on the device (exact_step.py's
``new_state`` and ``write_masked_u``; ``lst_kernels.fold_rows_``), with no host read."""
import copy
import itertools

import pytest
import torch

from lst_lightning.losses import LOSSES
from lst_lightning.spherical import driver
from lst_lightning.spherical import exact_step

from head_pairs import make_pair, no_host_reads, rel, step_both

D, d = 300, 8
BASE_LR = 0.05
#: the largest lr a hard step takes: past it a loss's curvature is too small for a singular B
LR_CAP = 100.0
#: the relative error each step (loss, dL/dH, W) against the float64 naive head
TOL = {torch.float64: 1e-9, torch.float32: 2e-4}


def singular_lr(f, H: torch.Tensor, idx: torch.Tensor, off: float) -> float | None:
    """The lr at which this step's B/c has the eigenvalue ``off`` (0: singular), for a batch whose
    rows are one h repeated (A = (2 lr / c) (sum g_q) h h^T, rank one; no weight decay, no P),
    from the loss gradients a copy of the head computes (its draw is the head's own); None where
    that lr is not in (0, LR_CAP]."""
    probe = copy.deepcopy(f)
    Hx, idx, T = probe.prepare(H.to(probe.dtype), idx, None, step=True)
    draws, route = driver.before_step(probe, Hx.shape[0])
    _, fwd = exact_step.forward(probe.plan, driver.step_state(probe), exact_step.Batch(Hx, idx, T), draws, route)
    curvature = 2.0 * float(fwd.gq.sum()) * float(Hx[0].double().pow(2).sum())
    lr = (1.0 - off) / curvature if curvature > 0 else None
    return lr if lr is not None and lr <= LR_CAP else None


def targets(g: torch.Generator, m: int) -> torch.Tensor:
    """K = 2 targets with padding and a class repeated in a row."""
    idx = torch.randint(0, 40, (m, 2), generator=g)
    idx[0, 1] = -1
    if m > 1:
        idx[1, 1] = idx[1, 0]
    return idx


def hard_steps(f, n, m: int, steps: int, seed: int = 0) -> tuple[float, int]:
    """``steps`` steps of both heads: every other one on m copies of one row at the lr that makes
    B/c's eigenvalue 0.01, -0.01 or 0 (h scaled by 1, 3, 0.3, 0.1 or 10 and the targets drawn up
    to 4 times, until one reaches it; else at LR_CAP), the others at BASE_LR on random rows.
    (the worst relative error, the nearly singular steps taken)."""
    g = torch.Generator().manual_seed(seed)
    worst, reached = 0.0, 0
    for t in range(steps):
        H, idx, lr = torch.randn(m, d, generator=g, dtype=torch.float64), targets(g, m), BASE_LR
        if t % 2 == 0:
            h, found = H[:1].expand(m, d), None
            for _, scale in itertools.product(range(4), (1.0, 3.0, 0.3, 0.1, 10.0)):
                found = singular_lr(f, scale * h, idx, (0.01, -0.01, 0.0)[(t // 2) % 3])
                if found is not None:
                    break
                if scale == 10.0:
                    idx = targets(g, m)
            H, lr, reached = scale * h, LR_CAP if found is None else found, reached + (found is not None)
        f.lr = n.lr = lr
        worst = max(worst, *step_both(f, n, H, idx))
    return worst, reached


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("sync_every", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_every_loss_stays_exact_through_nearly_singular_steps(loss, m, sync_every, dtype):
    f, n = make_pair(loss, D=D, d=d, dtype=dtype, ref_dtype=torch.float64, sync_every=sync_every)
    worst, reached = hard_steps(f, n, m, steps=12)
    assert worst < TOL[dtype]
    assert int(f.steps) == 12 and int(f.skipped_nonfinite) == 0
    # nearly singular steps (at m = 4 the Z-loss's summed g_q can stay negative: large-lr steps
    # instead): each way of checking folds some
    assert int(f.folds) > 0 and (reached >= 1 or m > 1), f.stats()


@pytest.fixture
def aot_eager(monkeypatch):
    """The compiled step's graph (Dynamo, AOTAutograd, the fold as one mutating op) without
    Inductor's code generation: the loss sweep in a fraction of the compile time."""
    torch._dynamo.reset()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    monkeypatch.setattr(driver, "_compiled", {})
    yield
    torch._dynamo.reset()


#: the Z-loss, the squared error and the spherical softmax in float64, the default's in float32 (the
#: others: -m slow; every loss folds eager in test_every_loss_stays_exact_through_nearly_singular_steps)
FAST_COMPILED = {("f64", "zloss"), ("f64", "mse"), ("f64", "spherical_softmax"), ("f32", "sampled")}
COMPILED_CASES = [pytest.param(loss, dtype, id=f"{name}-{loss}",
                               marks=[] if (name, loss) in FAST_COMPILED else [pytest.mark.slow])
                  for name, dtype in (("f64", torch.float64), ("f32", torch.float32)) for loss in sorted(LOSSES)]


@pytest.mark.parametrize("loss,dtype", COMPILED_CASES)
def test_the_compiled_graph_folds_on_the_device(aot_eager, loss, dtype):
    f, n = make_pair(loss, D=D, d=d, dtype=dtype, ref_dtype=torch.float64, sync_every=64)
    f.compile_step = True
    worst, reached = hard_steps(f, n, 1, steps=12)
    assert worst < TOL[dtype] and int(f.skipped_nonfinite) == 0
    assert reached >= 1 and int(f.folds) > 0


#: float32 and the squared error (4 nearly singular steps of 8 reached, each folded) by default; float64
#: (one Inductor compile more, -m slow) is Inductor's step to 1e-12 in
#: test_compiled.py::test_the_compiled_default_step_equals_the_eager_and_the_naive_head and the
#: spherical softmax's fold in float64 is test_the_compiled_graph_folds_on_the_device[f64-spherical_softmax]
INDUCTOR_CASES = [pytest.param("spherical_softmax", torch.float64, marks=pytest.mark.slow),
                  pytest.param("mse", torch.float32)]


@pytest.mark.parametrize("loss,dtype", INDUCTOR_CASES)
def test_the_inductor_compiled_step_folds_on_the_device(monkeypatch, loss, dtype):
    torch._dynamo.reset()
    monkeypatch.setattr(driver, "_compiled", {})
    f, n = make_pair(loss, D=D, d=d, dtype=dtype, ref_dtype=torch.float64, sync_every=64)
    f.compile_step = True
    worst, _ = hard_steps(f, n, 4, steps=8)
    assert worst < TOL[dtype] and int(f.skipped_nonfinite) == 0
    assert int(f.folds) > 0
    torch._dynamo.reset()


@pytest.mark.parametrize("inverse", ["woodbury", "solve", "products"])
def test_a_fold_reads_nothing_on_the_host(monkeypatch, inverse):
    """Exactly singular steps on each route under device flags: folded, and not one read."""
    f, n = make_pair("mse", D=D, d=d, sync_every=64, stabiliser={"inverse": inverse})
    H = torch.randn(1, d, dtype=torch.float64)
    f.lr = n.lr = 1.0 / (2.0 * float(H.pow(2).sum()))  # the squared error's g_q is 1 at m = 1
    idx = torch.tensor([[3]])
    step_both(f, n, H, idx)  # the first step fills the device lr
    with no_host_reads(monkeypatch):
        for _ in range(3):
            f(H.clone().requires_grad_(), idx).backward()
    for _ in range(3):
        n(H.clone().requires_grad_(), idx).backward()
    assert rel(f.weight(), n.weight()) < 1e-9
    assert int(f.folds) == 4 and int(f.skipped_nonfinite) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("step_mode", ["fused", "cuda_graph"])
def test_on_cuda_a_compiled_fold_never_waits_for_the_gpu(step_mode):
    """Exactly singular steps on CUDA, compiled (and replayed from a graph): each folded by the
    Triton kernel that reads its flag on the device, under ``set_sync_debug_mode("error")``;
    W equal to the float64 naive head's."""
    f, n = make_pair("mse", D=D, d=d, sync_every=64)
    f.to("cuda")
    f.compile_step, f.step = True, step_mode
    H = torch.randn(1, d, dtype=torch.float64)
    f.lr = n.lr = 1.0 / (2.0 * float(H.pow(2).sum()))
    idx = torch.tensor([[3]])
    Hc, idc = H.cuda(), idx.cuda()
    for _ in range(2):  # the compile, a capture
        f(Hc.clone().requires_grad_(), idc).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            f(Hc.clone().requires_grad_(), idc).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(5):
        n(H.clone().requires_grad_(), idx).backward()
    assert rel(f.weight().cpu(), n.weight()) < 1e-9
    assert int(f.folds) == 5 and int(f.skipped_nonfinite) == 0
