"""A synthetic next-token task for scale: Zipfian classes over ``D`` (up to 10^7 and
more) with learnable structure, generated on the fly from the example id alone.

Each example is a short Markov chain: ``x_0 ~ Zipf(D)``; then with probability
``p_rule`` ``x_{t+1} = x_t XOR 1`` (a neighbour of about the same frequency), else a
fresh Zipf draw. Context ``x_0..x_{n-1}``, target ``x_n``: a model that learns the
rule predicts the target with probability about ``p_rule``, a unigram model cannot.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import Dataset

_MASK32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    # A 32-bit integer mixer on int64 (products stay below 2^63: no overflow).
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def zipf_ranks(u: Tensor, num_classes: int) -> Tensor:
    """Map uniforms in [0, 1) to class ids with P(r) ~ 1/(r+1) (continuous Zipf, s=1)."""
    r = torch.exp(u.double() * math.log(num_classes + 1)).floor().long() - 1
    return r.clamp_(0, num_classes - 1)


def zipf_counts(num_classes: int, total: float = 1e9) -> Tensor:
    """Expected class counts (decreasing) for heads that need frequencies."""
    r = torch.arange(num_classes, dtype=torch.float64)
    p = torch.log((r + 2) / (r + 1)) / math.log(num_classes + 1)
    return (p * total).round().clamp_(min=1).long()


class SyntheticZipf(Dataset):
    """``size`` examples; ``dataset[ids]`` -> ``(context (b, n), target (b,))``, or with
    ``sequences`` the chain as a sequence, every position a target: ``(x_0..x_{n-1},
    x_1..x_n)``, both (b, n). The input ids are reduced modulo ``input_vocab_size`` (the
    body's embedding rows)."""

    def __init__(self, num_classes: int, context_size: int, size: int, *, p_rule: float = 0.5,
                 seed: int = 0, input_vocab_size: int | None = None, sequences: bool = False):
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if not 0.0 <= p_rule <= 1.0:
            raise ValueError(f"p_rule must be in [0, 1], got {p_rule}")
        self.num_classes, self.context_size, self.size = num_classes, context_size, size
        self.p_rule, self.seed, self.sequences = p_rule, seed, sequences
        self.input_vocab_size = min(num_classes, input_vocab_size or num_classes)

    def __len__(self) -> int:
        return self.size

    def _uniform(self, ids: Tensor, stream: int) -> Tensor:
        key = _hash32(ids * 0x9E3779B1 + self.seed * 0x85EBCA6B + stream)
        return _hash32(key + 0x27D4EB2F).double() / 2.0**32

    def __getitem__(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        ids = torch.as_tensor(ids, dtype=torch.long)
        n = self.context_size
        x = zipf_ranks(self._uniform(ids, 0), self.num_classes)
        chain = [x]
        for t in range(1, n + 1):
            fresh = zipf_ranks(self._uniform(ids, 2 * t), self.num_classes)
            follow = self._uniform(ids, 2 * t + 1) < self.p_rule
            nxt = x ^ 1
            nxt = torch.where(nxt < self.num_classes, nxt, x)
            x = torch.where(follow, nxt, fresh)
            chain.append(x)
        seq = torch.stack(chain, 1)
        return seq[:, :n] % self.input_vocab_size, seq[:, 1:] if self.sequences else seq[:, n]
