"""Validation of per-class frequency counts (ids sorted by decreasing frequency): it lives in
``lst_lightning.heads.samplers`` (the unigram proposal needs it); named here too."""
from __future__ import annotations

from ..heads.samplers import check_class_counts

__all__ = ["check_class_counts"]
