"""Data: corpora, vocabulary, n-gram windows, the synthetic Zipf task, data modules.

The data modules are named here lazily, so that ``lst_lightning.data.synthetic`` (the
Zipf law, torch only) imports without Lightning and ``datasets``."""
from __future__ import annotations

import importlib

_WHERE = {"SyntheticDataModule": "datamodule", "TextDataModule": "datamodule", "Vocabulary": "vocab"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
