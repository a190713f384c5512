"""The papers' feed-forward n-gram language model body: concatenated context
embeddings, hidden layers, last hidden layer of size d (the head's input)."""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .sizes import check_sizes

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


class NgramMLP(nn.Module):
    """``[n x embed_dim, *hidden_sizes, hidden_dim]``; the Z-loss paper's net1 is
    ``context_size=10, embed_dim=512, hidden_sizes=[2048, 2048], hidden_dim=512``."""

    def __init__(self, vocab_size: int, context_size: int, embed_dim: int = 64,
                 hidden_sizes: Sequence[int] = (256,), hidden_dim: int = 128, activation: str = "relu",
                 dropout: float = 0.0, final_activation: bool = True, sparse_embedding: bool = False):
        super().__init__()
        check_sizes(dropout, embed_dim=embed_dim, hidden_sizes=hidden_sizes, hidden_dim=hidden_dim)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {sorted(_ACTIVATIONS)}, not {activation!r}")
        self.context_size, self.hidden_dim = context_size, hidden_dim
        # sparse: row-sparse gradients, stepped by the row-sparse optimiser (app/optimizers.py)
        self.input_embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse_embedding)
        sizes = [context_size * embed_dim, *hidden_sizes, hidden_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2 or final_activation:
                layers.append(_ACTIVATIONS[activation]())
                if dropout > 0:
                    layers.append(nn.Dropout(dropout))
        self.layers = nn.Sequential(*layers)
        nn.init.normal_(self.input_embedding.weight, std=embed_dim**-0.5)

    def forward(self, context: Tensor) -> Tensor:
        """context (m, n) int64 -> hidden (m, hidden_dim)."""
        return self.layers(self.input_embedding(context).flatten(1))
