"""scripts/logit_spread.py: the normaliser's relative standard deviation from S sampled classes,
plain and with the Taylor control variate, exact for given logits."""
from __future__ import annotations

import pytest
import torch

import logit_spread as ls


def test_constant_logits_need_no_sample_and_the_control_variate_is_exact_there():
    o = torch.full((2, 1000), 3.0, dtype=torch.float64)
    q = ls.proposals(1000)["uniform"]
    sigma, plain, taylor = ls.relative_sds(o, q, 64)
    assert torch.allclose(sigma, torch.zeros(2, dtype=torch.float64)) and torch.allclose(plain, torch.zeros(2, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(taylor, torch.zeros(2, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("spread,plain_sd,taylor_sd", [(0.5, 0.023, 0.004), (1.0, 0.055, 0.026)])
def test_gaussian_logits_match_the_sampled_estimate(spread, plain_sd, taylor_sd):
    """D = 10^5, S = 512 uniform draws: the relative sd of Z-hat as measured by sampling (0.023 to
    0.004 at sigma 0.5, 0.055 to 0.026 at sigma 1)."""
    g = torch.Generator().manual_seed(0)
    o = spread * torch.randn(4, 100_000, generator=g, dtype=torch.float64)
    sigma, plain, taylor = ls.relative_sds(o, ls.proposals(100_000)["uniform"], 512)
    assert sigma.mean().item() == pytest.approx(spread, rel=0.01)
    assert plain.mean().item() == pytest.approx(plain_sd, rel=0.1)
    assert taylor.mean().item() == pytest.approx(taylor_sd, rel=0.2)
    # the exact sd agrees with drawing: 2000 estimates of Z from 512 uniform draws
    e = o[0].exp()
    draws = torch.randint(0, 100_000, (2000, 512), generator=g)
    z_hat = 100_000 * e[draws].mean(1)
    assert (z_hat.std() / e.sum()).item() == pytest.approx(plain[0].item(), rel=0.1)
