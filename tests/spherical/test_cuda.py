"""The factored head on a CUDA device: equal to the naive head step for step, and its step
replayed from a CUDA graph bit for bit the eager sync-free step over many steps, the lr
changed at every step without a new capture, with and without sampled classes drawn inside
the graph. CUDA only (``-m gpu``): the GPU suite's ``tests`` part runs them (docs/gpu.md)."""
import copy

import pytest
import torch

from lst_lightning.losses import LOSSES
from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.spherical.graph_step import CudaGraphStep

from head_pairs import batch, deferred, make_pair, run_steps, state

pytestmark = pytest.mark.gpu


def captured(step: CudaGraphStep) -> dict:
    """The step's graphs by their Neumann factors (compared by identity: no new capture)."""
    return {k: v[0] for k, v in step.graphs.items()}


@pytest.mark.parametrize("loss,preconditioner", [(loss, None) for loss in sorted(LOSSES)] + [pytest.param("sampled", {}, id="sampled-preconditioned")])
def test_factored_equals_naive_on_cuda(loss, preconditioner):
    """float32 factored head on the GPU (its Triton kernels) against the float64 naive head;
    padding, a class repeated within a row and across rows (head_pairs.batch); and lst-train's
    default, ``loss=sampled`` with the right preconditioner."""
    f, n = make_pair(loss, D=3000, d=64, bias=True, dtype=torch.float32, ref_dtype=torch.float64,
                     lr=0.02, weight_decay=0.001, device="cuda", preconditioner=preconditioner)
    assert f.V.is_cuda and n.W.is_cuda
    # as tests/spherical/test_factored.py's float32 test: the spherical softmax amplifies rounding
    tol = 1e-2 if loss == "spherical_softmax" else 2e-4
    run_steps(f, n, steps=50, m=33, K=3, classes=200, tol=tol)


@pytest.mark.parametrize("D,d,m,K", [(60, 8, 16, 2), (100_000, 512, 1024, 1)])
def test_graph_step_is_the_eager_step_bit_for_bit(D, d, m, K):
    eager = deferred(num_classes=D, hidden_dim=d, sync_every=8, device="cuda", dtype=torch.float32)
    graphed = copy.deepcopy(eager)
    step = CudaGraphStep(graphed, m=m, K=K)
    graphs = captured(step)
    assert state(graphed) == state(eager)  # warm-up and capture change nothing
    for i in range(200):
        eager.lr = graphed.lr = 0.05 / (1 + 0.1 * i)  # a schedule: read from a device scalar at each replay
        H, idx = batch(m, d, D, K, dtype=torch.float32)
        H, idx = H.cuda(), idx.cuda()
        loss_e, dH_e = eager.train_step(H, idx)
        loss_g, dH_g = step(H, idx)
        assert torch.equal(loss_g, loss_e) and torch.equal(dH_g, dH_e), f"step {i}"
    assert captured(step) == graphs  # no new capture
    assert state(graphed) == state(eager) and int(graphed.steps) == int(eager.steps) == 200


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("D,d,m,K,S", [(60, 8, 16, 2, 40), (100_000, 512, 1024, 1, 512)])
def test_graph_step_with_sampled_classes_is_the_eager_step_bit_for_bit(D, d, m, K, S, shared):
    """loss="sampled": the negatives drawn inside the graph by the head's device generator, a new
    draw at each replay (the eager head draws from an equal generator), 100 steps, lr changed at
    every step; at D = 60, S = 40 the draws repeat and hit the targets in every step. With the
    right preconditioner, as lst-train's default head (its Cholesky factorisation in the graph)."""
    eager = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=S, shared=shared, seed=3), sync_every=8,
                                  device="cuda", dtype=torch.float32, lr=0.5, init_std=0.1, preconditioner={})
    graphed = copy.deepcopy(eager)
    eager.negatives.draw_on(eager.device)  # what CudaGraphStep does to the graphed head
    step = CudaGraphStep(graphed, m=m, K=K)
    graphs = captured(step)
    assert state(graphed) == state(eager)
    assert torch.equal(graphed.negatives.device_generator.get_state(), eager.negatives.device_generator.get_state())
    for i in range(100):
        eager.lr = graphed.lr = 0.5 / (1 + 0.1 * i)
        H, idx = batch(m, d, D, K, dtype=torch.float32)
        H, idx = H.cuda(), idx.cuda()
        loss_e, dH_e = eager.train_step(H, idx)
        loss_g, dH_g = step(H, idx)
        assert torch.equal(loss_g, loss_e) and torch.equal(dH_g, dH_e), f"step {i}"
    assert captured(step) == graphs
    assert state(graphed) == state(eager) and int(graphed.steps) == int(eager.steps) == 100
    assert torch.equal(graphed.negatives.device_generator.get_state(), eager.negatives.device_generator.get_state())


@pytest.mark.parametrize("loss", ["zloss", "sampled"])
def test_graph_step_with_adaptive_factors_is_the_eager_step_bit_for_bit(loss):
    """``stabiliser.neumann="adaptive"``: a read of the flags (every 8 steps) changes the
    products route's Neumann factors (6 until the first read, then those for 4 x the rho seen);
    the graph is captured again for the new number, and stays the eager step bit for bit."""
    kw = dict(negatives=dict(num=40, seed=3), preconditioner={}) if loss == "sampled" else {}
    eager = FactoredSphericalHead(60, 8, loss=loss, sync_every=8, device="cuda", dtype=torch.float32, lr=0.5,
                                  init_std=0.1, stabiliser={"inverse": "products", "neumann": "adaptive"}, **kw)
    graphed = copy.deepcopy(eager)
    if loss == "sampled":
        eager.negatives.draw_on(eager.device)
    step = CudaGraphStep(graphed, m=16, K=2)
    for i in range(100):
        eager.lr = graphed.lr = 0.5 / (1 + 0.1 * i)
        H, idx = batch(16, 8, 60, 2, dtype=torch.float32)
        H, idx = H.cuda(), idx.cuda()
        loss_e, dH_e = eager.train_step(H, idx)
        loss_g, dH_g = step(H, idx)
        assert torch.equal(loss_g, loss_e) and torch.equal(dH_g, dH_e), f"step {i}"
        assert graphed.step_checks.factors == eager.step_checks.factors
    assert len(step.graphs) >= 2 and min(step.graphs) < 6  # captured again for fewer factors
    assert state(graphed) == state(eager) and int(graphed.steps) == int(eager.steps) == 100


def test_a_state_loaded_on_the_cpu_then_moved_steps_on_the_gpu_with_its_flags_there():
    """A checkpoint loaded on the CPU, the head then moved (``model.cuda()``): the flags' rho bound
    (the adaptive rule's, in the state) moves too, so the step reads no CPU tensor."""
    a = deferred(num_classes=60, hidden_dim=8, sync_every=4)
    for _ in range(3):
        H, idx = batch(5, 8, 60, 2)
        a(H.requires_grad_(), idx).backward()
    b = deferred(num_classes=60, hidden_dim=8, sync_every=4)
    b.load_state_dict(a.state_dict())
    b.cuda()
    assert b.step_checks.rho_max.is_cuda
    for _ in range(5):
        H, idx = batch(5, 8, 60, 2)
        b(H.cuda().requires_grad_(), idx.cuda()).backward()
    assert int(b.steps) == 8 and b.step_checks.rho_max.is_cuda
