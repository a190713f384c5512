"""Contiguous token sequences over tokenised documents, for bodies that read whole
sequences (the transformer): every position is a next-token example, a document's last
chunk is padded (target -1, input id 0) rather than run into the next document."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .flat import FlatDocuments


class TokenSequences(Dataset):
    """Each document (after ``bos_id`` when given) is cut into chunks of ``length`` targets:
    chunk ``c`` of a document ``x`` has inputs ``x[cL : cL+L]`` and targets
    ``x[cL+1 : cL+L+1]``. Indexed by a 1-D tensor of chunk ids; returns
    ``(inputs (b, L) int64, targets (b, L) int64)``, targets -1 past a document's end."""

    def __init__(self, documents: Sequence[Sequence[int]] | FlatDocuments, length: int, bos_id: int | None = None):
        if length < 1:
            raise ValueError(f"the sequence length must be >= 1, got {length}")
        self.length = length
        if not isinstance(documents, FlatDocuments):
            documents = FlatDocuments.from_lists(documents)
        flat = documents.with_heads(1, bos_id)
        self.longest_document = flat.longest
        # one input and its target at least; room to read past the end
        self.tokens = torch.from_numpy(np.concatenate([flat.tokens, np.zeros(length + 1, np.int32)]))
        self.starts = torch.from_numpy(flat.positions(0, length, last=1))
        self.ends = torch.from_numpy(flat.ends(0, length, last=1))
        self._offsets = torch.arange(length)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(idx)
        pos = self.starts[idx][:, None] + self._offsets
        real = pos + 1 < self.ends[idx][:, None]  # the target lies inside the document
        inputs = self.tokens[pos].long().masked_fill(~real, 0)
        return inputs, self.tokens[pos + 1].long().masked_fill(~real, -1)
