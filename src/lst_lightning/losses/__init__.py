"""The zoo of spherical losses. Adding a loss means adding one module and one line here."""
from __future__ import annotations

from .base import NormalisedSphericalLoss, SphericalLoss
from .mse import MSELoss
from .sampled_composite import SampledCompositeLoss, SampledSlots
from .spherical_softmax import SphericalSoftmaxLoss
from .taylor_softmax import TaylorSoftmaxLoss
from .zloss import ZLoss

LOSSES: dict[str, type[SphericalLoss]] = {
    cls.name: cls for cls in (MSELoss, SphericalSoftmaxLoss, TaylorSoftmaxLoss, ZLoss, SampledCompositeLoss)
}


def make_loss(name: str, **kwargs) -> SphericalLoss:
    """Build a loss by name, e.g. ``make_loss("zloss", a=0.1, b=10.0)``."""
    try:
        cls = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown spherical loss {name!r}; choose one of {sorted(LOSSES)}") from None
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"bad hyperparameters for loss {name!r}: {err}") from None


__all__ = ["LOSSES", "make_loss", "SphericalLoss", "NormalisedSphericalLoss", "MSELoss",
           "SphericalSoftmaxLoss", "TaylorSoftmaxLoss", "ZLoss", "SampledCompositeLoss", "SampledSlots"]
