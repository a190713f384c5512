"""Lightning data modules: n-gram windows over a text corpus, or the synthetic Zipf
task. Both expose what the model needs before training: ``num_classes``,
``input_vocab_size``, ``class_counts`` (decreasing), ``context_size`` and ``vocab``.

With ``sequences=True`` (``lst-train`` sets it for a body that ``reads_sequences``)
they serve contiguous sequences of ``sequence_length`` tokens instead, every position a
target, and ``context_size`` is that length. ``batch_size``, ``eval_batch_size`` and
``max_eval_examples`` count target tokens either way: a batch holds
``batch_size // sequence_length`` sequences (at least one), so the head sees about as
many rows per step from either kind of body."""
from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .corpus import SPLITS
from .ngram import EpochBatchSampler, NgramWindows
from .resumable_loader import ResumableLoader
from .sequences import TokenSequences
from .sources import CorpusSource, LinuxSource, PythonCode
from .synthetic import SyntheticZipf, zipf_counts
from .tokens import Tokenised, tokenise
from .vocab import BOS, Vocabulary, tokenize

log = logging.getLogger(__name__)


class _PaddedIds(Dataset):
    """``dataset[ids]`` where id ``EpochBatchSampler.PAD`` (-1) gives a filler example:
    example 0's context and target -1 (padding), so every rank can run the same number
    of equal-sized evaluation batches without counting an example twice."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        pad = ids == EpochBatchSampler.PAD
        if not bool(pad.any()):
            return self.dataset[ids]
        context, target = self.dataset[ids.clamp(min=0)]
        return context, target.masked_fill(pad.view(-1, *[1] * (target.dim() - 1)), -1)


class _WindowDataModule(pl.LightningDataModule):
    num_classes: int
    input_vocab_size: int
    class_counts: Tensor
    vocab: Vocabulary | None = None

    def __init__(self, batch_size: int, eval_batch_size: int | None, seed: int, num_workers: int,
                 max_eval_examples: int | None, sequences: bool = False, sequence_length: int = 32):
        super().__init__()
        if sequences and sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
        for name, value, optional in (("batch_size", batch_size, False), ("eval_batch_size", eval_batch_size, True),
                                      ("max_eval_examples", max_eval_examples, True)):
            if not (optional and value is None) and value < 1:  # refused here, not at the first batch
                raise ValueError(f"{name} must be >= 1{' or null' if optional else ''}, got {value}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.sequences, self.sequence_length = sequences, sequence_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.seed, self.num_workers, self.max_eval_examples = seed, num_workers, max_eval_examples
        self.splits: dict[str, Dataset] = {}

    def _examples(self, tokens: int) -> int:
        """Examples (windows, or sequences) that hold about ``tokens`` targets."""
        return max(1, tokens // self.sequence_length) if self.sequences else tokens

    def _loader(self, split: str, train: bool, rank: int | None = None, world_size: int | None = None) -> DataLoader:
        if not self.splits:
            raise RuntimeError("call setup() before asking for dataloaders")
        ds = self.splits[split]
        if rank is None:
            trainer = self.trainer
            rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        limit = None if train or self.max_eval_examples is None else self._examples(self.max_eval_examples)
        if train:
            self.check_one_batch(len(ds), world_size)
        sampler = EpochBatchSampler(
            len(ds), self._examples(self.batch_size if train else self.eval_batch_size), shuffle=train,
            seed=self.seed, drop_last=train, rank=rank, world_size=world_size, limit=limit,
        )
        # batch_size=None: the sampler yields whole batches of ids, the dataset
        # gathers them in one indexing op. Training resumes mid-epoch (ResumableLoader).
        kind, extra = (ResumableLoader, {"seed": self.seed}) if train else (DataLoader, {})
        return kind(_PaddedIds(ds), sampler=sampler, batch_size=None, num_workers=self.num_workers,
                    persistent_workers=self.num_workers > 0, **extra)

    def check_one_batch(self, examples: int, world_size: int = 1) -> None:
        """Refuse a training split of ``examples`` that fills no batch of the world's (the loader
        drops a last partial batch, so no step would train)."""
        batch = self._examples(self.batch_size)
        if examples < world_size * batch:
            what = f"sequences of {self.sequence_length} tokens" if self.sequences else "examples"
            each = f" on each of {world_size} processes" if world_size > 1 else ""
            raise ValueError(f"the training split gives {examples:,} {what}, fewer than one batch of "
                             f"{world_size * batch:,} (data.batch_size={self.batch_size}{each}), so no step would "
                             "train: lower data.batch_size, or give more training data")

    def eval_dataloader(self, split: str, rank: int = 0, world_size: int = 1) -> DataLoader:
        """An evaluation split as ``rank`` of ``world_size`` sees it (default: all of it,
        whatever the trainer's world)."""
        return self._loader(split, False, rank, world_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)


class TextDataModule(_WindowDataModule):
    """n-gram windows (or sequences) over a tokenised corpus: one of corpus.py's
    (``source``: ``embedded``, ``files``, ``hub``) or a source-code corpus
    (``python_code``, ``linux_source``: sources.py), tokenised once and cached as arrays
    (tokens.py). ``path``: the text files (``files``), the uv.lock that names the
    packages (``python_code``; null: the project's), the kernel's tarball
    (``linux_source``; null: Debian's). ``max_tokens`` takes the code corpora's first
    tokens only (null: all)."""

    def __init__(self, source: str = "embedded", *, path=None, name: str | None = None,
                 subset: str | None = None, text_column: str = "text", sample_by: str = "paragraph",
                 tokenizer: str = "words", vocab_size: int | None = 10000, min_count: int = 1,
                 context_size: int = 6, pad_start: bool = False, val_fraction: float = 0.05,
                 test_fraction: float = 0.05, min_doc_tokens: int = 20, max_tokens: int | None = None,
                 batch_size: int = 128, eval_batch_size: int | None = None, max_eval_examples: int | None = None,
                 num_workers: int = 0, seed: int = 0, sequences: bool = False, sequence_length: int = 32):
        super().__init__(batch_size, eval_batch_size, seed, num_workers, max_eval_examples, sequences,
                         sequence_length)
        if context_size < 1:
            raise ValueError(f"data.context_size must be >= 1, got {context_size}")
        if vocab_size is not None and vocab_size < 2:
            raise ValueError(f"data.vocab_size must be >= 2 (or null), got {vocab_size}")
        if min_count < 1:  # every word of the corpus occurs once: below 1 would keep what 1 keeps
            raise ValueError(f"data.min_count must be >= 1 (1: every word), got {min_count}")
        tokenize("", tokenizer)  # rejects an unknown tokenizer now
        self.tokenizer, self.vocab_size, self.min_count = tokenizer, vocab_size, min_count
        self.max_tokens = max_tokens
        self.source = make_source(source, dict(
            source=source, path=path, name=name, subset=subset, text_column=text_column, sample_by=sample_by,
            val_fraction=val_fraction, test_fraction=test_fraction, min_doc_tokens=min_doc_tokens, seed=seed),
            max_tokens)
        self.context_size = sequence_length if sequences else context_size
        self.pad_start = pad_start
        self.extra = (BOS,) if pad_start else ()
        self.tokenised: Tokenised | None = None

    def prepare_data(self) -> None:
        """Tokenise the corpus into the cache (once; on rank 0), and refuse a vocabulary it
        cannot fill as soon as its types are counted."""
        self._vocabulary()

    def _vocabulary(self) -> Vocabulary:
        if self.tokenised is None:
            self.tokenised = tokenise(self.source, self.tokenizer, self.max_tokens)
        if self.vocab is None:
            hint = []
            if self.tokenised.meta.get("capped"):
                hint.append(f"raise data.max_tokens={self.max_tokens} (or null: the whole corpus)")
            if self.tokenizer in ("words", "code"):  # a tokenizer.json has the types it has
                hint.append("tokenise with data.tokenizer=whitespace (case and punctuation kept: more types)")
            self.vocab = self.tokenised.vocabulary(self.vocab_size, self.min_count, self.extra,
                                                   "".join(f"; or {h}" for h in hint))
        return self.vocab

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        vocab = self._vocabulary()
        bos = vocab.index[BOS] if self.pad_start else None
        splits = {}
        for s in SPLITS:
            encoded = self.tokenised.encode(s, vocab, self.extra)
            if self.sequences:
                splits[s] = TokenSequences(encoded, self.sequence_length, bos)
                if len(splits[s]) == 0:
                    raise ValueError(f"no {s} document has two tokens: nothing to predict")
                continue
            w = NgramWindows(encoded, self.context_size, bos)
            if len(w) == 0:
                raise ValueError(
                    f"data.context_size={self.context_size} is longer than every {s} document "
                    f"(the longest has {w.longest_document} tokens); lower it or set data.pad_start=true"
                )
            splits[s] = w
        self.check_one_batch(len(splits["train"]))  # one process's; the loader checks the trainer's world
        self.splits = splits
        self.num_classes = self.input_vocab_size = len(vocab)
        self.class_counts = vocab.counts.clone()
        log.info("%s", self.tokenised.describe(vocab, self.extra))

    def save_vocab(self, path: str | Path) -> None:
        self.vocab.save(path)


def make_source(source: str, corpus_args: dict, max_tokens: int | None):
    """The documents of ``data.source`` (sources.py)."""
    fractions = corpus_args["val_fraction"], corpus_args["test_fraction"]
    if min(fractions) < 0 or sum(fractions) >= 1:  # refused now, not after a whole tokenisation
        raise ValueError(f"data.val_fraction={fractions[0]} and data.test_fraction={fractions[1]} must each be >= 0, "
                         "with a sum below 1 (the rest is the training split)")
    if source == "python_code":
        return PythonCode(corpus_args["path"], *fractions)
    if source == "linux_source":
        return LinuxSource(corpus_args["path"], *fractions)
    if source not in ("embedded", "files", "hub"):
        raise ValueError(f"data.source must be embedded, files, hub, python_code or linux_source, not {source!r}")
    if max_tokens is not None:
        raise ValueError(f"data.max_tokens caps data.source=python_code and linux_source only (not {source}): "
                         "set it to null")
    return CorpusSource(corpus_args)


class SyntheticDataModule(_WindowDataModule):
    """The synthetic Zipf task (no vocabulary, no SimLex). As sequences, each example is
    one chain of ``sequence_length`` + 1 tokens (``train_size``/``eval_size`` count chains)."""

    def __init__(self, num_classes: int = 100_000, *, context_size: int = 4, p_rule: float = 0.5,
                 train_size: int = 1_000_000, eval_size: int = 20_000, input_vocab_size: int | None = 100_000,
                 batch_size: int = 256, eval_batch_size: int | None = None, max_eval_examples: int | None = None,
                 num_workers: int = 0, seed: int = 0, sequences: bool = False, sequence_length: int = 32):
        super().__init__(batch_size, eval_batch_size, seed, num_workers, max_eval_examples, sequences,
                         sequence_length)
        for name, value in (("context_size", context_size), ("train_size", train_size), ("eval_size", eval_size),
                            ("input_vocab_size", 1 if input_vocab_size is None else input_vocab_size)):
            if value < 1:  # a negative input_vocab_size made negative input ids
                raise ValueError(f"data.{name} must be >= 1{' (or null)' if name == 'input_vocab_size' else ''}, "
                                 f"got {value}")
        self.num_classes = num_classes
        self.context_size = sequence_length if sequences else context_size
        self.args = dict(num_classes=num_classes, context_size=self.context_size, p_rule=p_rule,
                         input_vocab_size=input_vocab_size, sequences=sequences)
        self.sizes = {"train": train_size, "validation": eval_size, "test": eval_size}
        self.input_vocab_size = SyntheticZipf(size=0, **self.args).input_vocab_size
        self.class_counts = zipf_counts(num_classes)

    def setup(self, stage: str | None = None) -> None:
        # Disjoint seeds per split, so validation examples are not training examples.
        for i, (s, n) in enumerate(self.sizes.items()):
            self.splits[s] = SyntheticZipf(size=n, seed=self.seed * 3 + i + 1, **self.args)
