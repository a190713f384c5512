"""spherical/settings.py: a spherical head's default is lst-train's head (``loss="sampled"``, its
sampled classes and the preconditioner on), and ``"auto"`` turns them on only with a loss that
samples classes; the integrations take the same default."""
from __future__ import annotations

import pytest
from torch import nn

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead
from lst_lightning.spherical.settings import AUTO, on_with_sampled


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_the_default_head_is_the_sampled_loss_with_its_classes_and_the_preconditioner(cls):
    head = cls(1000, 8)
    assert head.loss_fn.name == "sampled" and head.negatives is not None and head.preconditioner is not None
    plain = cls(1000, 8, loss="zloss")
    assert plain.negatives is None and plain.preconditioner is None
    off = cls(1000, 8, preconditioner=None)
    assert off.negatives is not None and off.preconditioner is None


def test_auto_is_on_only_with_a_loss_that_samples_classes():
    assert on_with_sampled(AUTO, True) == {} and on_with_sampled(AUTO, False) is None
    assert on_with_sampled({"num": 8}, False) == {"num": 8} and on_with_sampled(None, True) is None


def test_the_integrations_take_the_heads_default():
    from lst_lightning.integrations.hf import head_from_linear  # noqa: PLC0415

    head = head_from_linear(nn.Linear(8, 1000, bias=False), {}, "factor_lm_head")
    assert head.loss_fn.name == "sampled" and head.negatives is not None and head.preconditioner is not None
