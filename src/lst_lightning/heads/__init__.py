"""The interface every output head implements (``OutputHead``), and every head by name.

The heads themselves live where their idea lives: the exact spherical head in
``lst_lightning.spherical``, the baselines in ``lst_lightning.baselines``. They are
re-exported here lazily, so that ``from lst_lightning.heads import SoftmaxHead`` works
without this package importing the others (they import this one).
"""
from __future__ import annotations

import importlib

from .base import OutputHead

_WHERE = {
    "SphericalHeadBase": "spherical", "FactoredSphericalHead": "spherical", "NaiveSphericalHead": "spherical",
    "CudaGraphStep": "spherical",
    "SoftmaxHead": "baselines", "HierarchicalSoftmaxHead": "baselines", "AdaptiveSoftmaxHead": "baselines",
    "SampledSoftmaxHead": "baselines",
}

__all__ = ["OutputHead", *_WHERE]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"lst_lightning.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'lst_lightning.heads' has no attribute {name!r}")
