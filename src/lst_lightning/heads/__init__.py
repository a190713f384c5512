"""Output heads: the exact factored spherical head, its naive reference, and baselines."""
from .base import OutputHead

# Baselines (issue 4).
from .adaptive import AdaptiveSoftmaxHead
from .hsoftmax import HierarchicalSoftmaxHead
from .sampled import SampledSoftmaxHead
from .softmax import SoftmaxHead

__all__ = ["OutputHead"]
__all__ += ["SoftmaxHead", "HierarchicalSoftmaxHead", "AdaptiveSoftmaxHead", "SampledSoftmaxHead"]
