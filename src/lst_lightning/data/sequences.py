"""Contiguous token sequences over tokenised documents, for bodies that read whole
sequences (the transformer): every position is a next-token example, a document's last
chunk is padded (target -1, input id 0) rather than run into the next document."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset


class TokenSequences(Dataset):
    """Each document (after ``bos_id`` when given) is cut into chunks of ``length`` targets:
    chunk ``c`` of a document ``x`` has inputs ``x[cL : cL+L]`` and targets
    ``x[cL+1 : cL+L+1]``. Indexed by a 1-D tensor of chunk ids; returns
    ``(inputs (b, L) int64, targets (b, L) int64)``, targets -1 past a document's end."""

    def __init__(self, documents: Sequence[Sequence[int]], length: int, bos_id: int | None = None):
        if length < 1:
            raise ValueError(f"the sequence length must be >= 1, got {length}")
        self.length = length
        head = [bos_id] if bos_id is not None else []
        flat: list[int] = []
        starts: list[Tensor] = []
        ends: list[Tensor] = []
        longest = 0
        for doc in documents:
            doc = head + list(doc)
            longest = max(longest, len(doc))
            if len(doc) >= 2:  # one input and its target at least
                first = torch.arange(len(flat), len(flat) + len(doc) - 1, length)
                starts.append(first)
                ends.append(torch.full_like(first, len(flat) + len(doc)))  # one past the document's last token
            flat += doc
        self.longest_document = longest
        self.tokens = torch.tensor(flat + [0] * (length + 1), dtype=torch.long)  # room to read past the end
        self.starts = torch.cat(starts) if starts else torch.empty(0, dtype=torch.long)
        self.ends = torch.cat(ends) if ends else torch.empty(0, dtype=torch.long)
        self._offsets = torch.arange(length)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(idx)
        pos = self.starts[idx][:, None] + self._offsets
        real = pos + 1 < self.ends[idx][:, None]  # the target lies inside the document
        inputs = self.tokens[pos].masked_fill(~real, 0)
        return inputs, self.tokens[pos + 1].masked_fill(~real, -1)
