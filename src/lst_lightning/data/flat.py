"""Tokenised documents as two arrays, never as Python lists: the ids of every document one
after the other (``tokens``, int32) and where each document starts (``offsets``, int64,
one more than the documents: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``).
The n-gram windows and the sequences are built from them with vectorised numpy, so a
corpus of 10^8 tokens costs a few bytes a token, not the ~40 of a list of ints."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FlatDocuments:
    tokens: np.ndarray  # (N,) int32
    offsets: np.ndarray  # (documents + 1,) int64, offsets[0] == 0, offsets[-1] == N

    @classmethod
    def from_lists(cls, documents: Sequence[Sequence[int]]) -> FlatDocuments:
        lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
        tokens = np.fromiter((t for d in documents for t in d), dtype=np.int32, count=int(lengths.sum()))
        return cls(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def longest(self) -> int:
        return int(self.lengths.max()) if len(self.offsets) > 1 else 0

    def with_heads(self, n: int, token: int | None) -> FlatDocuments:
        """Every document after ``n`` copies of ``token`` (itself when ``token`` is None or n is 0)."""
        if token is None or n == 0:
            return self
        docs = len(self.offsets) - 1
        out = np.full(len(self.tokens) + n * docs, token, dtype=np.int32)
        # token j of document i moves right by n (i + 1)
        shift = np.repeat(np.arange(1, docs + 1, dtype=np.int64) * n, self.lengths)
        out[np.arange(len(self.tokens), dtype=np.int64) + shift] = self.tokens
        return FlatDocuments(out, self.offsets + n * np.arange(docs + 1, dtype=np.int64))

    def positions(self, skip: int, step: int = 1, last: int = 0) -> np.ndarray:
        """Positions ``p = start + skip + k step`` < ``end - last`` in each document, in order."""
        counts = self._counts(skip, step, last)
        # p = step i + (start + skip - step (index of the document's first position)), i running
        out = np.arange(int(counts.sum()), dtype=np.int64)
        out *= step
        out += np.repeat(self.offsets[:-1] + skip - step * (np.cumsum(counts) - counts), counts)
        return out

    def ends(self, skip: int, step: int = 1, last: int = 0) -> np.ndarray:
        """The end of the document (one past its last token) of each of :meth:`positions`."""
        return np.repeat(self.offsets[1:], self._counts(skip, step, last))

    def _counts(self, skip: int, step: int, last: int) -> np.ndarray:
        return np.maximum(-(-(self.lengths - skip - last) // step), 0)
