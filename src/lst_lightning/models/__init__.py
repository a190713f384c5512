"""Bodies: map a context window (m, n) of token ids to the last hidden layer (m, d), or
(``reads_sequences``) a sequence (b, T) to the hidden state of every position (b, T, d)."""
from .gpt import GPT
from .lstm import LSTMBody
from .ngram_mlp import NgramMLP

__all__ = ["GPT", "LSTMBody", "NgramMLP"]
