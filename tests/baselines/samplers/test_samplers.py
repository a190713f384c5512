"""Proposal distributions: the laws they claim, the sum-tree against the direct way."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from lst_lightning.baselines.samplers import SAMPLERS, KernelSumTree, make_sampler
from lst_lightning.baselines.samplers.kernel_functions import QuadraticKernel, RandomFourierKernel


def empirical(ids, n):
    return torch.bincount(ids.reshape(-1), minlength=n).double()


def assert_draws_follow(ids, probs, min_p=1e-3):
    """Chi-square goodness of fit of draws to probs (classes below min_p pooled)."""
    obs = empirical(ids, probs.numel())
    exp = probs.double() * ids.numel()
    big = probs > min_p
    obs = torch.cat([obs[big], obs[~big].sum(0, keepdim=True)])
    exp = torch.cat([exp[big], exp[~big].sum(0, keepdim=True)])
    keep = exp > 0
    assert obs[~keep].sum() == 0, "drew a class of probability 0"
    if keep.sum() < 2:
        return
    obs, exp = obs[keep], exp[keep]
    p = chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue
    assert p > 1e-4, f"draws do not follow the claimed law (chi-square p = {p:.2g})"


# -- static proposals --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["uniform", "log_uniform", "unigram"])
def test_static_sampler_law(name):
    n = 30
    counts = torch.randint(0, 50, (n,)).sort(descending=True).values.float()
    counts[0] = 100
    s = make_sampler(name, num_classes=n, class_counts=counts)
    probs = s.log_prob(torch.arange(n)).double().exp()
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0, dtype=torch.float64))
    if name == "log_uniform":
        k = torch.arange(n, dtype=torch.float64)
        torch.testing.assert_close(probs, (torch.log(k + 2) - torch.log(k + 1)) / math.log(n + 1))
    if name == "unigram":
        torch.testing.assert_close(probs, counts.double() ** 0.75 / (counts.double() ** 0.75).sum())
    ids, log_q = s.sample(20000, generator=torch.Generator().manual_seed(0))
    assert ids.shape == (20000,) and ids.dtype == torch.long
    torch.testing.assert_close(log_q, s.log_prob(ids))
    assert_draws_follow(ids, probs)


def test_unigram_power_and_errors():
    counts = torch.tensor([8.0, 4.0, 2.0, 1.0])
    flat = make_sampler("unigram", num_classes=4, class_counts=counts, power=0.0)
    torch.testing.assert_close(flat.log_prob(torch.arange(4)).exp(), torch.full((4,), 0.25))
    with pytest.raises(ValueError, match="power"):
        make_sampler("unigram", num_classes=4, class_counts=counts, power=-1.0)
    with pytest.raises(ValueError, match="shape"):
        make_sampler("unigram", num_classes=5, class_counts=counts)
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler("zipf", num_classes=4)
    with pytest.raises(ValueError, match="num_samples"):
        make_sampler("uniform", num_classes=4).sample(0)
    assert set(SAMPLERS) >= {"uniform", "log_uniform", "unigram", "rff", "quadratic"}


# -- kernel proposals: tree against direct -----------------------------------------------------
KERNELS = {
    # nu large and D_rff small: many negative kernel values, so the clamping paths run.
    "rff_noisy": lambda d: RandomFourierKernel(d, num_features=8, nu=8.0, seed=1),
    "rff": lambda d: RandomFourierKernel(d, num_features=64, nu=2.0, seed=2),
    "quadratic": lambda d: QuadraticKernel(d, alpha=4.0),
}


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


def test_rff_kernel_is_unbiased_gaussian():
    """phi(x).phi(y) averages to exp(-nu ||x - y||^2 / 2) on unit vectors (over seeds)."""
    x, y = torch.nn.functional.normalize(torch.randn(2, 5), dim=1)
    nu = 3.0
    vals = torch.stack([
        (RandomFourierKernel(5, 256, nu, seed=s).query(x[None]) * RandomFourierKernel(5, 256, nu, seed=s)
         .query(y[None])).sum() for s in range(200)])
    target = math.exp(-nu * float(((x - y) ** 2).sum()) / 2)
    assert abs(vals.mean().item() - target) < 4 * vals.std().item() / math.sqrt(200) + 1e-4


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


# -- RF-softmax approaches the softmax ----------------------------------------------------------
def test_rff_proposal_approaches_softmax_as_d_rff_grows():
    """Total-variation distance between the RF-softmax proposal (nu = tau) and the softmax of
    tau cos(h, c), averaged over kernel seeds, decreases with D_rff."""
    torch.manual_seed(0)
    n, d, tau = 200, 8, 2.0
    C, h = torch.randn(n, d), torch.randn(4, d)
    norm = torch.nn.functional.normalize
    softmax = torch.softmax(tau * norm(h, dim=1) @ norm(C, dim=1).T, 1).double()
    tv = []
    for D_rff in (4, 32, 256, 2048):
        dist = 0.0
        for seed in range(3):
            s = make_sampler("rff", num_classes=n, hidden_dim=d, num_features=D_rff, nu=tau, seed=seed)
            s.sync(C)
            dist += 0.5 * (s.direct_probs(h) - softmax).abs().sum(1).mean().item() / 3
        tv.append(dist)
    assert all(a > b for a, b in zip(tv, tv[1:])), tv
    assert tv[-1] < 0.06, tv  # about 0.04 at D_rff = 2048


@pytest.mark.parametrize("name,kwargs", [("rff", {"num_features": 16, "nu": 2.0}), ("quadratic", {"alpha": 2.0})])
def test_direct_and_tree_draws_share_one_law(name, kwargs):
    n, d = 60, 4
    C, h = torch.randn(n, d), torch.randn(2, d)
    by = {}
    for draw in ("tree", "direct"):
        s = make_sampler(name, num_classes=n, hidden_dim=d, leaf_size=4, draw=draw, **kwargs)
        s.sync(C)
        assert s.uses_tree(8) == (draw == "tree")
        ids, log_q = s.sample(4000, h, generator=torch.Generator().manual_seed(1))
        direct = s.direct_probs(h)
        torch.testing.assert_close(log_q.double(), direct.gather(1, ids).log(), rtol=1e-4, atol=1e-4)
        for j in range(2):
            assert_draws_follow(ids[j], direct[j])
        by[draw] = direct
    torch.testing.assert_close(by["tree"], by["direct"])
    auto = make_sampler(name, num_classes=n, hidden_dim=d, leaf_size=4, **kwargs)
    auto.sync(C)
    assert not auto.uses_tree(8) and auto.uses_tree(1)  # 60 classes: direct for 8 draws, tree for 1
    with pytest.raises(ValueError, match="draw"):
        make_sampler(name, num_classes=n, hidden_dim=d, draw="fast", **kwargs)
