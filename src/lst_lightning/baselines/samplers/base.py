"""The base class of the proposals: it lives in ``lst_lightning.heads.samplers`` (shared with
the exact head's sampled slots); named here too."""
from __future__ import annotations

from ...heads.samplers import Sampler, check_num_samples

__all__ = ["Sampler", "check_num_samples"]
