"""A word vocabulary with ids sorted by decreasing frequency (id 0 most frequent),
as the hierarchical and adaptive heads and the log-uniform sampler need."""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

UNK = "<unk>"
BOS = "<s>"

_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?", re.UNICODE)
# Source code: identifiers, numbers (with a fraction, an exponent, a base or a suffix:
# 0x1F, 1.5e-3, 10UL) and each other mark on its own, case kept.
_CODE = re.compile(r"[^\W\d]\w*|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?\w*|[^\w\s]", re.UNICODE)
TOKENIZERS = ("words", "whitespace", "code")
#: a corpus token spelled like one of the vocabulary's own (``<unk>``, ``<s>``: wikitext's literal
#: ``<unk>``, a tokenizer's special pieces) is a class of its own, spelled with this mark before it
MARK = "\u2060"


def _own(tokens: list[str]) -> list[str]:
    """``tokens`` with those spelled like ``<unk>`` or ``<s>`` marked (``MARK``)."""
    return [MARK + t if t == UNK or t == BOS else t for t in tokens]


def tokenize(text: str, kind: str = "words") -> list[str]:
    """``text``'s tokens by the tokenizer ``kind`` (``tokenizer_of``)."""
    return tokenizer_of(kind)(text)


def tokenizer_of(kind: str) -> Callable[[str], list[str]]:
    """The tokenizer ``data.tokenizer`` names, text -> tokens: ``words``, lowercase alphabetic words
    (matches SimLex); ``whitespace``, split only (for pre-tokenised corpora such as wikitext and
    lm1b); ``code``, identifiers, numbers and single punctuation marks, case kept (the source-code
    corpora); or a Hugging Face ``tokenizer.json`` (or a folder holding one, as a model's checkpoint
    does), read now: its pieces, no special tokens added. The two that can spell ``<unk>`` or ``<s>``
    (whitespace, a tokenizer.json) mark such a token as a class of its own (``MARK``)."""
    if kind == "words":
        return lambda text: _WORD.findall(text.lower())
    if kind == "whitespace":
        return lambda text: _own(text.split()) if "<" in text else text.split()
    if kind == "code":
        return _CODE.findall
    path = tokenizer_file(kind)
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415  (with transformers: the hf extra)
    except ImportError as e:
        raise ImportError(f"data.tokenizer={kind!r} needs the tokenizers package (pip install tokenizers, or "
                          "lst-lightning[hf])") from e
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust parser's own error, one line
        raise ValueError(f"data.tokenizer={kind!r}: {path} is not a Hugging Face tokenizer.json ({e})") from e
    return lambda text: _own(tok.encode(text, add_special_tokens=False).tokens)


def tokenizer_file(kind: str) -> Path | None:
    """The ``tokenizer.json`` that ``data.tokenizer`` names (None for the built-in tokenizers)."""
    if kind in TOKENIZERS:
        return None
    path = Path(kind) / "tokenizer.json" if Path(kind).is_dir() else Path(kind)
    if not path.is_file():
        raise ValueError(f"data.tokenizer must be one of {', '.join(TOKENIZERS)} or a Hugging Face tokenizer.json "
                         f"(or a folder holding one), not {kind!r}")
    return path


class Vocabulary:
    """Word <-> id with per-id counts, ids in decreasing count order."""

    def __init__(self, words: list[str], counts: list[int] | torch.Tensor):
        self.words = list(words)
        self.counts = torch.as_tensor(counts, dtype=torch.long)
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.words) != len(self.counts) or len(self.index) != len(self.words):
            raise ValueError("vocabulary words must be unique and match the counts")
        self.unk_id = self.index.get(UNK, -1)

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def build(cls, documents: Iterable[list[str]], max_size: int | None = None, min_count: int = 1,
              extra: tuple[str, ...] = (), hint: str = "") -> Vocabulary:
        """Keep the ``max_size - 1 - len(extra)`` most frequent words seen at least
        ``min_count`` times; all others map to ``<unk>``, counted as one word."""
        counter: Counter[str] = Counter()
        for doc in documents:
            counter.update(doc)
        # Ties broken by word so the ids do not depend on document order.
        ranked = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls.from_ranked([w for w, _ in ranked], [c for _, c in ranked], max_size, min_count, extra, hint)

    @classmethod
    def from_ranked(cls, words: list[str], counts: Sequence[int], max_size: int | None = None, min_count: int = 1,
                    extra: tuple[str, ...] = (), hint: str = "") -> Vocabulary:
        """:meth:`build` from the training words already ranked (by decreasing count, ties
        by word) with their counts, every count >= 1. ``hint`` ends the message that
        refuses a ``max_size`` larger than the words allow."""
        largest = len(words) + 1 + len(extra)
        if max_size is not None and max_size > largest:
            raise ValueError(
                f"data.vocab_size={max_size} is larger than the corpus allows: its training split has "
                f"{len(words)} distinct tokens, so the largest valid value is {largest} (with <unk>"
                f"{f' and {len(extra)} special tokens' if extra else ''}): lower it or set it to null (every "
                f"type){hint}"
            )
        keep_n = len(words) if max_size is None else max_size - 1 - len(extra)
        counts = torch.as_tensor(counts, dtype=torch.long)
        kept = counts[:keep_n]
        kept = kept[: int((kept >= min_count).sum())]  # counts decrease: the words kept are a prefix
        # <unk> counts the words it replaces, and sorts by that count after the kept words of
        # the same count; the specials count 1 and come last (not 0: the log-uniform sampler
        # and Huffman coding dislike zero counts).
        unk = max(int(counts.sum() - kept.sum()), 1)
        at = int((kept >= unk).sum())
        return cls([*words[:at], UNK, *words[at : len(kept)], *extra],
                   torch.cat([kept[:at], torch.tensor([unk]), kept[at:], torch.ones(len(extra), dtype=torch.long)]))

    def encode(self, tokens: list[str]) -> list[int]:
        get, unk = self.index.get, self.unk_id
        return [get(t, unk) for t in tokens]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"words": self.words, "counts": self.counts.tolist()}))

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        d = json.loads(Path(path).read_text())
        return cls(d["words"], d["counts"])
