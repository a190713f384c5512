"""The plan (plan.py) chooses the kernel ops' implementation once, for the head's device, when it
is made (``StepPlan.kernels``); the step calls the chosen ops unchecked."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import lst_kernels as lk
from lst_kernels import ops
from lst_lightning.spherical import FactoredSphericalHead


def make_head(loss: str = "zloss", width: int = 8) -> FactoredSphericalHead:
    sampled = loss == "sampled"
    return FactoredSphericalHead(num_classes=50, hidden_dim=width, loss=loss, bias=True,
                                 generator=torch.Generator().manual_seed(0), negatives={} if sampled else None,
                                 preconditioner={} if sampled else None)


def test_a_cpu_heads_plan_holds_the_torch_ops_and_its_gathers_and_scatter_are_theirs():
    plan = make_head().plan
    assert plan.kernels is ops.TORCH
    assert (plan.gather_dot, plan.gather_sum, plan.scatter_rows) == (
        ops.TORCH.gather_dot, ops.TORCH.gather_sum, ops.TORCH.scatter_add_rows_)


def test_the_plan_asks_for_the_ops_of_the_heads_device_when_it_is_made(monkeypatch):
    f = make_head()
    seen = []
    monkeypatch.setattr(lk, "ops_for", lambda device, impl="auto": seen.append(device) or ops.TORCH)
    f.double()  # a move: the plan made again
    assert seen == [f.device] and f.plan.kernels is ops.TORCH


@pytest.mark.skipif(not ops._TRITON_IMPORTABLE, reason="the Triton ops need triton (a Linux x86-64 dependency)")
@pytest.mark.parametrize("loss", ["zloss", "sampled"])
@pytest.mark.parametrize("m", [4, 12], ids=["through_M", "from_products"])
def test_a_step_on_the_triton_ops_matches_the_torch_ops(loss, m):
    """Every op the step calls, Triton's (in Triton's interpreter on the CPU, as the kernel tests
    run them): the same step as on torch's, to float32's rounding (m > d: Q from d x d products,
    the ids sorted once for gram_rows and the write's scatter)."""
    heads = [make_head(loss), make_head(loss)]
    heads[1].plan = dataclasses.replace(heads[1].plan, kernels=lk.ops_for("cpu", "triton"))
    plan = heads[1].plan
    assert plan.kernels.impl == "triton" and plan.scatter_rows is plan.kernels.scatter_add_rows_
    g = torch.Generator().manual_seed(1)
    H = torch.randn(m, 8, generator=g)
    idx = torch.randint(0, 50, (m, 2), generator=g)
    grads = []
    for f in heads:
        Hf = H.clone().requires_grad_(True)
        f(Hf, idx).backward()
        grads.append(Hf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)
    for name, t in heads[0].state_dict().items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            torch.testing.assert_close(heads[1].state_dict()[name], t, rtol=1e-4, atol=1e-5, msg=name)
    assert int(heads[1].steps) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_plan_sums_a_blocks_repeated_columns_in_order_on_its_device(device):
    """A shared block's repeated columns are summed in the order of the draw: by torch's
    ``index_add_`` on the CPU, which adds in that order, by the deterministic scatter on CUDA (whose
    ``index_add_`` adds by float atomics): the same sums (the CUDA plan's function run here on the
    CPU's tensors)."""
    from lst_lightning.spherical import negatives
    from lst_lightning.spherical.plan import StepPlan
    plan = StepPlan(device=device)
    chosen = plan.index_add_in_order
    assert (chosen is negatives.add_rows_) if device == "cpu" else (chosen.func is negatives.add_in_order_)
    g = torch.Generator().manual_seed(0)
    rows, ids = torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (40,), generator=g)
    got = torch.zeros(5, 6, dtype=torch.float64)
    chosen(got, 0, ids, rows)
    assert torch.equal(got, torch.zeros(5, 6, dtype=torch.float64).index_add_(0, ids, rows))
