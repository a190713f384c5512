"""A word vocabulary with ids sorted by decreasing frequency (id 0 most frequent),
as the hierarchical and adaptive heads and the log-uniform sampler need."""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

UNK = "<unk>"
BOS = "<s>"

_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?", re.UNICODE)


def tokenize(text: str, kind: str = "words") -> list[str]:
    """``words``: lowercase alphabetic words (matches SimLex); ``whitespace``: split only
    (for pre-tokenised corpora such as wikitext and lm1b)."""
    if kind == "words":
        return _WORD.findall(text.lower())
    if kind == "whitespace":
        return text.split()
    raise ValueError(f"tokenizer must be 'words' or 'whitespace', not {kind!r}")


class Vocabulary:
    """Word <-> id with per-id counts, ids in decreasing count order."""

    def __init__(self, words: list[str], counts: list[int]):
        if len(words) != len(counts) or len(set(words)) != len(words):
            raise ValueError("vocabulary words must be unique and match the counts")
        self.words = list(words)
        self.counts = torch.tensor(counts, dtype=torch.long)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.unk_id = self.index.get(UNK, -1)

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def build(cls, documents: Iterable[list[str]], max_size: int | None = None, min_count: int = 1,
              extra: tuple[str, ...] = ()) -> Vocabulary:
        """Keep the ``max_size - 1 - len(extra)`` most frequent words seen at least
        ``min_count`` times; all others map to ``<unk>``, counted as one word."""
        counter: Counter[str] = Counter()
        for doc in documents:
            counter.update(doc)
        distinct = len(counter)
        if max_size is not None and max_size > distinct + 1 + len(extra):
            raise ValueError(
                f"data.vocab_size={max_size} is larger than the corpus allows: it has only "
                f"{distinct} distinct words (+ <unk> and {len(extra)} special tokens)"
            )
        # Ties broken by word so the ids do not depend on document order.
        ranked = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
        keep_n = len(ranked) if max_size is None else max_size - 1 - len(extra)
        kept = [(w, c) for w, c in ranked[:keep_n] if c >= min_count]
        unk = sum(counter.values()) - sum(c for _, c in kept)
        # Specials get count 1 so they sort last (not 0: the log-uniform sampler and
        # Huffman coding dislike zero counts).
        items = kept + [(UNK, max(unk, 1))] + [(t, 1) for t in extra]
        items.sort(key=lambda kv: -kv[1])  # stable: keeps the word order of ties
        return cls([w for w, _ in items], [c for _, c in items])

    def encode(self, tokens: list[str]) -> list[int]:
        get, unk = self.index.get, self.unk_id
        return [get(t, unk) for t in tokens]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"words": self.words, "counts": self.counts.tolist()}))

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        d = json.loads(Path(path).read_text())
        return cls(d["words"], d["counts"])
