"""Output heads: the exact factored spherical head, its naive reference, and baselines."""
from .base import OutputHead
from .factored import FactoredSphericalHead
from .graphed import CudaGraphStep
from .naive import NaiveSphericalHead
from .spherical import SphericalHeadBase

# Baselines (issue 4).
from .adaptive import AdaptiveSoftmaxHead
from .hsoftmax import HierarchicalSoftmaxHead
from .sampled import SampledSoftmaxHead
from .softmax import SoftmaxHead

__all__ = ["OutputHead", "SphericalHeadBase", "FactoredSphericalHead", "NaiveSphericalHead", "CudaGraphStep"]
__all__ += ["SoftmaxHead", "HierarchicalSoftmaxHead", "AdaptiveSoftmaxHead", "SampledSoftmaxHead"]
