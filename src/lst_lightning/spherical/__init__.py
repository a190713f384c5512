"""The exact spherical head of Vincent, de Brebisson & Bouthillier: the factored
O(m d^2) head, its explicit-W reference, and the ways to run its step
(inside ``loss.backward()``, fused in one call, or replayed from a CUDA graph).
The derivation the code follows is in docs/algorithm.md."""
from .base import SphericalHeadBase
from .factored import FactoredSphericalHead
from .graph_step import CudaGraphStep
from .naive import NaiveSphericalHead
from .negatives import Negatives

__all__ = ["SphericalHeadBase", "FactoredSphericalHead", "NaiveSphericalHead", "CudaGraphStep", "Negatives"]
