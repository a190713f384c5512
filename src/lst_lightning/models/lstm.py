"""A recurrent body: an LSTM reads the context window, its last state (projected)
is the head's input."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .sizes import check_sizes


class LSTMBody(nn.Module):
    def __init__(self, vocab_size: int, context_size: int, embed_dim: int = 64, lstm_size: int = 128,
                 num_layers: int = 1, hidden_dim: int = 128, dropout: float = 0.0, sparse_embedding: bool = False):
        super().__init__()
        check_sizes(dropout, embed_dim=embed_dim, lstm_size=lstm_size, num_layers=num_layers, hidden_dim=hidden_dim)
        self.context_size, self.hidden_dim = context_size, hidden_dim
        # sparse: row-sparse gradients, stepped by the row-sparse optimiser (app/optimizers.py)
        self.input_embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse_embedding)
        self.lstm = nn.LSTM(embed_dim, lstm_size, num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.proj = nn.Linear(lstm_size, hidden_dim)
        nn.init.normal_(self.input_embedding.weight, std=embed_dim**-0.5)

    def forward(self, context: Tensor) -> Tensor:
        out, _ = self.lstm(self.input_embedding(context))
        return torch.tanh(self.proj(out[:, -1]))
