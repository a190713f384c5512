"""Data: corpora, vocabulary, n-gram windows, the synthetic Zipf task, data modules."""
from .datamodule import SyntheticDataModule, TextDataModule
from .vocab import Vocabulary

__all__ = ["SyntheticDataModule", "TextDataModule", "Vocabulary"]
