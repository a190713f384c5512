"""Output heads: the exact factored spherical head, its naive reference, and baselines."""
from .base import OutputHead

__all__ = ["OutputHead"]
