"""Proposal distributions for sampled softmax, selectable by name: the static ones
(``lst_lightning.heads.samplers``) and the kernel ones (``lst_lightning.heads.kernel_sampler``),
both shared with the exact head's sampled slots, and the exact softmax."""
from __future__ import annotations

import inspect

from ...heads.kernel_sampler import ExactSoftmaxSampler, KernelSampler, QuadraticSampler, RFFSampler
from ...heads.samplers import LogUniformSampler, Sampler, UniformSampler, UnigramSampler
from ...heads.sum_tree import KernelSumTree

SAMPLERS: dict[str, type[Sampler]] = {
    "uniform": UniformSampler,
    "log_uniform": LogUniformSampler,
    "unigram": UnigramSampler,
    "rff": RFFSampler,
    "quadratic": QuadraticSampler,
    "exact": ExactSoftmaxSampler,
}


def make_sampler(name: str, *, num_classes: int, hidden_dim: int | None = None, class_counts=None,
                 **kwargs) -> Sampler:
    """Build a sampler by name, passing ``hidden_dim``/``class_counts`` only where it takes them."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {sorted(SAMPLERS)}")
    cls = SAMPLERS[name]
    params = inspect.signature(cls.__init__).parameters
    unknown = set(kwargs) - set(params)
    if unknown:
        raise TypeError(f"sampler {name!r} takes no argument(s) {sorted(unknown)}")
    if "hidden_dim" in params:
        kwargs["hidden_dim"] = hidden_dim
    if "class_counts" in params:
        kwargs["class_counts"] = class_counts
    return cls(num_classes=num_classes, **kwargs)


__all__ = ["SAMPLERS", "make_sampler", "KernelSampler", "RFFSampler", "QuadraticSampler", "ExactSoftmaxSampler",
           "KernelSumTree"]
