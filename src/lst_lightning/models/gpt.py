"""A small decoder-only transformer body (``model=gpt``): learned token and position
embeddings, pre-LayerNorm blocks of causal self-attention
(``F.scaled_dot_product_attention(is_causal=True)``) and an MLP, a final LayerNorm and
a projection to the head's width. It reads whole sequences (batch, T) and returns the
hidden state of every position (batch, T, hidden_dim): position t sees tokens 0..t only,
so every position is a next-token example (the data module serves sequences to bodies
with ``reads_sequences``)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .sizes import check_sizes


class CausalSelfAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, w // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, w))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, embed_dim: int, num_heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attn = CausalSelfAttention(embed_dim, num_heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_ratio * embed_dim), nn.GELU(), nn.Linear(mlp_ratio * embed_dim, embed_dim),
                                 nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``vocab_size`` input tokens, sequences of up to ``context_size`` positions."""

    reads_sequences = True  # the data module serves (batch, T) sequences, every position a target

    def __init__(self, vocab_size: int, context_size: int, embed_dim: int = 128, num_layers: int = 2,
                 num_heads: int = 4, mlp_ratio: int = 4, hidden_dim: int = 128, dropout: float = 0.0,
                 sparse_embedding: bool = False):
        super().__init__()
        check_sizes(dropout, embed_dim=embed_dim, num_layers=num_layers, num_heads=num_heads, mlp_ratio=mlp_ratio,
                    hidden_dim=hidden_dim)
        if embed_dim % num_heads:
            raise ValueError(f"model.embed_dim={embed_dim} must be a multiple of model.num_heads={num_heads}")
        if context_size < 1:
            raise ValueError(f"the sequence length (data.sequence_length) must be >= 1, got {context_size}")
        self.context_size, self.hidden_dim = context_size, hidden_dim
        self.input_embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse_embedding)
        self.position_embedding = nn.Embedding(context_size, embed_dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, dropout) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(embed_dim)
        self.proj = nn.Linear(embed_dim, hidden_dim)
        nn.init.normal_(self.input_embedding.weight, std=0.02)
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (b, T) int64, T <= context_size -> hidden (b, T, hidden_dim)."""
        t = tokens.shape[1]
        if t > self.context_size:
            raise ValueError(f"a sequence of {t} tokens is longer than the body's context_size={self.context_size}")
        x = self.drop(self.input_embedding(tokens) + self.position_embedding.weight[:t])
        for block in self.blocks:
            x = block(x)
        return self.proj(self.ln_f(x))
