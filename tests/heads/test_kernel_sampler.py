"""Kernel-based proposals (kernel_sampler.py): RF-softmax approaches the softmax as D_rff
grows; direct and tree draws share one law."""
from __future__ import annotations

import pytest
import torch

from lst_lightning.baselines.samplers import make_sampler

from sampler_laws import assert_draws_follow

# -- static proposals --------------------------------------------------------------------




# -- kernel proposals: tree against direct -----------------------------------------------------










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


@pytest.mark.parametrize("name,kwargs", [("rff", {"num_features": 16, "nu": 2.0}), ("quadratic", {"alpha": 2.0})])
def test_float64_embeddings_give_a_float64_tree_and_law(name, kwargs):
    """The exact head's float64 state: the tree and log q in float64 (sample_float64,
    log_prob_float64), equal to the direct law to rounding; sample/log_prob stay float32."""
    n, d = 60, 4
    C, h = torch.randn(n, d, dtype=torch.float64), torch.randn(3, d, dtype=torch.float64)
    s = make_sampler(name, num_classes=n, hidden_dim=d, leaf_size=4, draw="tree", **kwargs)
    s.sync(C)
    assert s.tree.sums.dtype == torch.float64
    ids, log_q = s.sample_float64(50, h, generator=torch.Generator().manual_seed(2))
    assert log_q.dtype == torch.float64
    torch.testing.assert_close(log_q, s.direct_probs(h).gather(1, ids).log(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.log_prob_float64(ids, h), log_q, rtol=1e-12, atol=1e-12)
    assert s.sample(5, h)[1].dtype == s.log_prob(ids, h).dtype == torch.float32
