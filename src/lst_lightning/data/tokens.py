"""A corpus tokenised once and kept on disk as numpy arrays, keyed by its files and the
settings that change the tokens (sources.py says what identifies each corpus).

The first run reads the documents once (a progress bar on a terminal), gives each
distinct token an id as it first meets it, writes the ids to disk as it goes, then
ranks the types by their training count (ties by the token) and rewrites the ids as
ranks. What it keeps, in ``$LST_CACHE_DIR/tokens/<corpus>-<tokenizer>-<key>/``:

- ``<split>.ids.npy`` (int32: each token's rank) and ``<split>.offsets.npy`` (int64:
  where each document starts), read memory-mapped;
- ``types.txt`` (the types by rank, one a line: ``_escaped``), ``counts.npy`` (their training counts);
- ``meta.json`` (documents and tokens per split, types, the seconds it took), written last.

Any vocabulary is then a prefix of the ranks (vocab.py's order), and encoding a split is
one table lookup: a later run, whatever ``data.vocab_size``, starts in seconds. Nothing
about the vocabulary is in the key, so a vocabulary larger than the corpus allows is
refused as soon as the types are counted, and at once on every later run.
"""
from __future__ import annotations

import array
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .corpus import SPLITS, cache_dir
from .flat import FlatDocuments
from .vocab import Vocabulary, tokenizer_file, tokenizer_of

log = logging.getLogger(__name__)

FORMAT = 3  # the layout and the tokenisers' version: a change makes new keys
_FLUSH = 1 << 20  # ids buffered before they are written
_CHUNK = 1 << 24  # ids encoded at a time


def token_cache() -> Path:
    """Where tokenised corpora are kept (``$LST_CACHE_DIR/tokens``)."""
    return cache_dir() / "tokens"


@dataclass
class Tokenised:
    """A tokenised corpus in the cache (what :func:`tokenise` returns)."""

    path: Path
    meta: dict
    built: bool = False  # by this process, not found in the cache

    @classmethod
    def open(cls, path: Path, built: bool = False) -> Tokenised:
        """The corpus cached in ``path``; one found there (not ``built`` by this call: its files just
        written) checked against its ``meta.json`` first (:meth:`check`)."""
        tokenised = cls(path, json.loads((path / "meta.json").read_text()), built)
        if not built:
            tokenised.check()
        return tokenised

    def check(self) -> None:
        """Raise ValueError (or the OSError of a missing file) where a file of the cache
        does not hold what ``meta.json`` says: a truncated or damaged cache, never read as
        if it were whole. Reads the ids once (min and max), not the text."""
        m, n = self.meta, int(self.meta["types"])
        for s in SPLITS:
            ids, offsets = self.ids(s), self.offsets(s)
            if ids.shape != (m["tokens"][s],) or offsets.shape != (m["documents"][s] + 1,) \
                    or int(offsets[0]) != 0 or int(offsets[-1]) != len(ids):
                raise ValueError(f"{s}.ids.npy or {s}.offsets.npy does not match meta.json")
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise ValueError(f"{s}.ids.npy holds ids outside [0, {n})")
        if np.load(self.path / "counts.npy", mmap_mode="r").shape != (n,):
            raise ValueError("counts.npy does not match meta.json")
        if (self.path / "types.txt").read_bytes().count(b"\n") != n - 1:
            raise ValueError(f"types.txt does not hold the {n} types of meta.json")

    def ids(self, split: str) -> np.ndarray:
        """The split's tokens as type ranks (int32, memory-mapped)."""
        return np.load(self.path / f"{split}.ids.npy", mmap_mode="r")

    def offsets(self, split: str) -> np.ndarray:
        return np.load(self.path / f"{split}.offsets.npy")

    def types(self, n: int | None = None) -> list[str]:
        """The first ``n`` types by rank (all of them when None), read from the cache."""
        with (self.path / "types.txt").open(encoding="utf-8", errors="surrogatepass", newline="\n") as f:
            return [_unescaped(line.removesuffix("\n")) for line in itertools.islice(f, n)]

    @property
    def train_types(self) -> int:
        return int(self.meta["train_types"])

    def vocabulary(self, max_size: int | None, min_count: int = 1, extra: tuple[str, ...] = (),
                   hint: str = "") -> Vocabulary:
        """vocab.py's vocabulary of the training split (``Vocabulary.build`` on its tokens)."""
        n = self.train_types
        counts = torch.from_numpy(np.load(self.path / "counts.npy")[:n])
        return Vocabulary.from_ranked(self.types(n), counts, max_size, min_count, extra, hint)

    def encode(self, split: str, vocab: Vocabulary, extra: tuple[str, ...] = ()) -> FlatDocuments:
        """The split in the ids of ``vocab`` (made by :meth:`vocabulary` with the specials
        ``extra``): the ranks it keeps move past ``<unk>``'s id, the others become ``<unk>``."""
        n, unk = kept(vocab, extra), vocab.unk_id
        table = np.full(int(self.meta["types"]), unk, dtype=np.int32)
        table[:unk] = np.arange(unk, dtype=np.int32)
        table[unk:n] = np.arange(unk + 1, n + 1, dtype=np.int32)
        return FlatDocuments(_lookup(table, self.ids(split)), self.offsets(split))

    def unknown(self, split: str, vocab: Vocabulary, extra: tuple[str, ...] = ()) -> int:
        """How many of the split's tokens ``vocab`` makes ``<unk>``."""
        return int(np.count_nonzero(self.ids(split) >= kept(vocab, extra)))

    def describe(self, vocab: Vocabulary, extra: tuple[str, ...] = ()) -> str:
        """One line: documents, tokens, types, the vocabulary kept and the unknown rate."""
        m = self.meta
        docs, toks = sum(m["documents"].values()), sum(m["tokens"].values())
        rates = {s: self.unknown(s, vocab, extra) / max(m["tokens"][s], 1) for s in SPLITS}
        unknown = sum(rates[s] * m["tokens"][s] for s in SPLITS) / max(toks, 1)
        capped = f" (the first {toks:,} up to data.max_tokens)" if m.get("capped") else ""
        return (f"data: {m['source']}, {m['tokenizer']} tokens: {docs:,} documents, {toks:,} tokens{capped}, "
                f"{m['types']:,} types ({self.train_types:,} in train); vocabulary {len(vocab):,} "
                f"({kept(vocab, extra):,} types kept, <unk>{''.join(f' and {t}' for t in extra)}); unknown "
                f"{100 * unknown:.2f} % of the tokens (train {100 * rates['train']:.2f} %, validation "
                f"{100 * rates['validation']:.2f} %, test {100 * rates['test']:.2f} %); "
                + (f"tokenised in {m['seconds']} s into {self.path}" if self.built else f"cached in {self.path}"))


def _lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``table[ids]`` (int32), in chunks: numpy widens the indices it takes to int64."""
    out = np.empty(len(ids), dtype=np.int32)
    for a in range(0, len(ids), _CHUNK):
        out[a : a + _CHUNK] = table[ids[a : a + _CHUNK]]
    return out


def _escaped(token: str) -> str:
    """``token`` on one line of types.txt: its backslashes doubled and its newlines written ``\\n`` (a
    tokenizer.json's pieces may hold both)."""
    return token.replace("\\", "\\\\").replace("\n", "\\n") if "\\" in token or "\n" in token else token


def _unescaped(line: str) -> str:
    """The token of a line of types.txt (``_escaped``'s inverse)."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], line) if "\\" in line else line


def kept(vocab: Vocabulary, extra: tuple[str, ...] = ()) -> int:
    """How many of the corpus's types ``vocab`` keeps (all but ``<unk>`` and the specials ``extra``)."""
    return len(vocab) - 1 - len(extra)


def cache_key(source, tokenizer: str, max_tokens: int | None) -> str:
    """The cache directory's name: the corpus, the tokenizer (a tokenizer.json by its content,
    wherever it lies: ``hf``) and a digest of what the tokens depend on."""
    file = tokenizer_file(tokenizer)
    name = tokenizer if file is None else "hf"
    what = {"format": FORMAT, "source": source.name, "key": source.key(),
            "tokenizer": tokenizer if file is None else hashlib.sha256(file.read_bytes()).hexdigest(),
            "max_tokens": max_tokens}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{source.name}-{name}-{digest}"


def tokenise(source, tokenizer: str, max_tokens: int | None = None) -> Tokenised:
    """``source``'s documents tokenised (sources.py), from the cache when they are there."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"data.max_tokens must be >= 1 (or null: every token), got {max_tokens}")
    pieces = tokenizer_of(tokenizer)  # an unknown tokenizer, before the long part; a tokenizer.json read once
    path = token_cache() / cache_key(source, tokenizer, max_tokens)
    if (path / "meta.json").is_file():
        try:
            return Tokenised.open(path)
        except (OSError, ValueError, EOFError, KeyError, TypeError) as e:  # damaged: tokenise again
            log.warning("data: the token cache %s is damaged (%s: %s); tokenising again", path, type(e).__name__,
                        " ".join(str(e).split()))
            damaged = path.with_name(f".damaged-{path.name}-{os.getpid()}")
            with contextlib.suppress(OSError):  # another process may have moved it first
                os.replace(path, damaged)
            shutil.rmtree(damaged, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        _build(source, tokenizer, pieces, max_tokens, work)
        try:
            os.replace(work, path)
        except OSError:  # another process finished the same corpus first
            if not (path / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Tokenised.open(path, built=True)


def _progress():
    """A rich progress bar on stderr where it is a terminal, else nothing (the log's lines say it)."""
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(file=sys.stderr)
    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                    TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(), TimeRemainingColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


def _build(source, tokenizer: str, pieces: Callable[[str], list[str]], max_tokens: int | None, out: Path) -> None:
    start = time.perf_counter()
    log.info("data: tokenising %s with the %s tokenizer%s, once: later runs read %s", source.name, tokenizer,
             f", up to {max_tokens:,} tokens" if max_tokens else "", out.parent)
    size = source.size()
    index: dict[str, int] = {}
    setdefault = index.setdefault
    buffers = {s: array.array("i") for s in SPLITS}
    lengths: dict[str, list[int]] = {s: [] for s in SPLITS}
    tokens = 0
    files = {s: (out / f"{s}.raw").open("wb") for s in SPLITS}
    with _progress() as bar, contextlib.closing(source.documents()) as documents:
        task = bar.add_task(f"tokenising {source.name}", total=max_tokens or size, tokens=0)
        for i, (split, text, done) in enumerate(documents):
            ids = [setdefault(t, len(index)) for t in pieces(text)]
            tokens += len(ids)
            if ids:
                buffers[split].extend(ids)
                lengths[split].append(len(ids))
                if len(buffers[split]) >= _FLUSH:
                    buffers[split].tofile(files[split])
                    del buffers[split][:]
            if i % 64 == 0:
                bar.update(task, completed=tokens if max_tokens else None, tokens=tokens)
            if not max_tokens:
                bar.advance(task, done)
            if max_tokens and tokens >= max_tokens:
                break
    for s in SPLITS:
        buffers[s].tofile(files[s])
        files[s].close()
    raw = {s: np.fromfile(out / f"{s}.raw", dtype=np.int32) for s in SPLITS}
    for s in SPLITS:
        if not len(raw[s]):
            raise ValueError(f"the {s} split of {source.name} has no tokens: nothing to train or evaluate on")
    types = list(index)
    del index
    counts = np.bincount(raw["train"], minlength=len(types))
    by_count = counts.tolist()
    order = np.array(sorted(range(len(types)), key=lambda i: (-by_count[i], types[i])), dtype=np.int64)
    rank = np.empty(len(types), dtype=np.int32)
    rank[order] = np.arange(len(types), dtype=np.int32)
    for s in SPLITS:
        np.save(out / f"{s}.ids.npy", _lookup(rank, raw[s]))
        np.save(out / f"{s}.offsets.npy", np.concatenate([[0], np.cumsum(lengths[s], dtype=np.int64)]))
        (out / f"{s}.raw").unlink()
    (out / "types.txt").write_text("\n".join(_escaped(types[i]) for i in order), "utf-8", "surrogatepass")
    np.save(out / "counts.npy", counts[order])
    meta = {"source": source.name, "tokenizer": tokenizer, "max_tokens": max_tokens,
            "capped": bool(max_tokens and tokens >= max_tokens),
            "documents": {s: len(lengths[s]) for s in SPLITS}, "tokens": {s: len(raw[s]) for s in SPLITS},
            "types": len(types), "train_types": int(np.count_nonzero(counts)),
            "seconds": round(time.perf_counter() - start, 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
