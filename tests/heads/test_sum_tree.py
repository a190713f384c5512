"""The sum-tree (sum_tree.py): its draws follow the direct law, and it stays in step with updates."""
from __future__ import annotations

import pytest
import torch

from lst_lightning.heads.kernel_functions import QuadraticKernel, RandomFourierKernel
from lst_lightning.heads.sum_tree import KernelSumTree

from sampler_laws import KERNELS, assert_draws_follow


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("n,leaf_size", [(37, 4), (16, 16), (5, 1), (1, 3)])
def test_tree_law_equals_direct(kernel, n, leaf_size):
    d, m = 6, 3
    tree = KernelSumTree(KERNELS[kernel](d), leaf_size)
    tree.build(torch.randn(n, d))
    h = torch.randn(m, d)
    direct = tree.direct_probs(h)
    torch.testing.assert_close(direct.sum(1), torch.ones(m, dtype=torch.float64))
    assert (direct >= 0).all()
    # log q of every class through the tree = the direct law.
    lq = tree.log_prob(h, torch.arange(n).expand(m, n))
    torch.testing.assert_close(lq.double().exp(), direct, rtol=1e-4, atol=1e-6)
    ids, log_q = tree.sample(h, 6000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(log_q.double(), direct.gather(1, ids).log(), rtol=1e-4, atol=1e-4)
    for j in range(m):
        assert_draws_follow(ids[j], direct[j])



def test_tree_law_is_the_clamped_kernel_when_values_are_positive():
    """Quadratic kernel values are > 0: the walk's law is exactly K(h, c) / sum K."""
    d, n = 4, 29
    kernel = QuadraticKernel(d, alpha=3.0)
    tree = KernelSumTree(kernel, leaf_size=4)
    C, h = torch.randn(n, d), torch.randn(2, d)
    tree.build(C)
    k = 3.0 * (h @ C.T) ** 2 + 1
    torch.testing.assert_close(tree.direct_probs(h), (k / k.sum(1, keepdim=True)).double())



@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_tree_stays_in_step_after_updates(kernel):
    d, n = 5, 41
    tree = KernelSumTree(KERNELS[kernel](d), leaf_size=4)
    C = torch.randn(n, d)
    tree.build(C)
    for step in range(3):
        rows = torch.randperm(n)[:5 + step]
        rows = torch.cat([rows, rows[:1]])  # a repeated row
        C[rows] = torch.randn(rows.numel(), d)
        tree.update(rows, C[rows])
    fresh = KernelSumTree(KERNELS[kernel](d), leaf_size=4)
    fresh.build(C)
    torch.testing.assert_close(tree.sums, fresh.sums, rtol=1e-5, atol=1e-5)
    h = torch.randn(4, d)
    torch.testing.assert_close(tree.log_prob(h, torch.arange(n).expand(4, n)),
                               fresh.log_prob(h, torch.arange(n).expand(4, n)), rtol=1e-4, atol=1e-4)



def test_tree_errors_leave_state():
    tree = KernelSumTree(RandomFourierKernel(3, 8), leaf_size=2)
    with pytest.raises(RuntimeError, match="build"):
        tree.sample(torch.randn(2, 3), 4)
    C = torch.randn(7, 3)
    tree.build(C)
    sums = tree.sums.clone()
    with pytest.raises(ValueError, match="class ids"):
        tree.update(torch.tensor([7]), torch.randn(1, 3))
    with pytest.raises(ValueError, match="finite"):
        tree.update(torch.tensor([1]), torch.full((1, 3), float("nan")))
    with pytest.raises(ValueError, match="non-finite"):
        tree.build(torch.full((7, 3), float("inf")))
    assert torch.equal(tree.sums, sums)
    with pytest.raises(ValueError, match="leaf_size"):
        KernelSumTree(RandomFourierKernel(3, 8), leaf_size=0)
    with pytest.raises(ValueError, match="nu"):
        RandomFourierKernel(3, 8, nu=-1.0)
