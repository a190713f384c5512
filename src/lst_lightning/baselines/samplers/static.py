"""Proposals that ignore the hidden row: uniform, log-uniform (Zipf over frequency-sorted
ids) and unigram^power. They live in ``lst_lightning.heads.samplers`` (shared with the exact
head's sampled slots); named here too."""
from __future__ import annotations

from ...heads.samplers import LogUniformSampler, StaticSampler, UniformSampler, UnigramSampler

__all__ = ["StaticSampler", "UniformSampler", "LogUniformSampler", "UnigramSampler"]
