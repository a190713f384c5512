"""Bodies: map a context window (m, n) of token ids to the last hidden layer (m, d)."""
from .lstm import LSTMBody
from .ngram_mlp import NgramMLP

__all__ = ["LSTMBody", "NgramMLP"]
