"""Output heads: the exact factored spherical head, its naive reference, and baselines."""
from .base import OutputHead
from .factored import FactoredSphericalHead
from .naive import NaiveSphericalHead
from .spherical import SphericalHeadBase

__all__ = ["OutputHead", "SphericalHeadBase", "FactoredSphericalHead", "NaiveSphericalHead"]
