"""A head's nested settings (the exact head's ``Negatives``, ``Stabiliser``, and the ``Preconditioner``
that the exact head and the sampled softmax share) from what a user or a Hydra config passes: the
dataclass itself or a dict of some of its fields."""
from __future__ import annotations

import dataclasses


def settings_from(cls: type, value, name: str):
    """``value`` as a ``cls``: itself, or ``cls(**value)`` for a dict whose keys are all its
    fields; anything else, or an unknown key, is refused in one line naming ``name``."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a {cls.__name__}, a dict or None, got {type(value).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"unknown {name} setting(s) {unknown}; the settings are {names}")
    return cls(**value)
