"""Proposals that ignore the hidden row (heads/samplers.py, built here by name through the
baselines' registry): their draws follow their laws."""
from __future__ import annotations

import math

import pytest
import torch

from lst_lightning.baselines.samplers import SAMPLERS, make_sampler

from sampler_laws import assert_draws_follow


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
    for bad in (dict(power=-1.0), dict(power="0.75"), dict(power=True), dict(smoothing=-1.0),
                dict(smoothing=float("inf"))):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a finite number >= 0") as err:
            make_sampler("unigram", num_classes=4, class_counts=counts, **bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="shape"):
        make_sampler("unigram", num_classes=5, class_counts=counts)
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler("zipf", num_classes=4)
    with pytest.raises(ValueError, match="num_samples"):
        make_sampler("uniform", num_classes=4).sample(0)
    assert set(SAMPLERS) >= {"uniform", "log_uniform", "unigram", "rff", "quadratic"}
