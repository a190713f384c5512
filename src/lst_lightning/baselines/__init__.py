"""The heads a researcher compares the exact spherical head against: full softmax,
hierarchical softmax, adaptive softmax and sampled softmax (with its samplers)."""
from .adaptive import AdaptiveSoftmaxHead
from .hsoftmax import HierarchicalSoftmaxHead
from .sampled import SampledSoftmaxHead
from .softmax import SoftmaxHead

__all__ = ["SoftmaxHead", "HierarchicalSoftmaxHead", "AdaptiveSoftmaxHead", "SampledSoftmaxHead"]
