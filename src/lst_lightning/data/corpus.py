"""Raw text corpora as HF ``datasets`` with ``train``/``validation``/``test`` splits of
documents (one ``text`` column), from the embedded Wikipedia extract, local files, or
the hub. Everything goes through ``datasets`` so caching and hub names share one path.

``datasets`` is imported where a corpus is loaded, not at the top: the synthetic task's data
module imports this module, and must run where ``datasets`` is not installed (a GPU machine
with torch but not the app's frameworks: docs/gpu.md).
"""
from __future__ import annotations

import bz2
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

from .files import not_utf8, text_files

if TYPE_CHECKING:
    import datasets

EMBEDDED_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SPLITS = ("train", "validation", "test")
#: the rule of ``_split_by_tokens`` and ``_carve_missing``, in the token cache's key (sources.py): a
#: change makes new keys, so no corpus is read with a split made by another rule
SPLIT_RULE = 2


def cache_dir() -> Path:
    """The project cache (``$LST_CACHE_DIR``, else ``~/.cache/lst_lightning``)."""
    return Path(os.environ.get("LST_CACHE_DIR", Path.home() / ".cache" / "lst_lightning"))


def _wiki_articles(path: str, min_tokens: int):
    # gensim's helpers strip the wiki markup; redirects and stubs are dropped.
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki  # noqa: PLC0415

    with bz2.BZ2File(path) as f:
        for title, text, _ in extract_pages(f):
            clean = filter_wiki(text)
            if len(clean.split()) >= min_tokens:
                yield {"title": title, "text": clean}


def _split_by_tokens(ds: datasets.Dataset, fractions: tuple[float, float], seed: int) -> datasets.DatasetDict:
    """Split documents (shuffled with ``seed``) so validation and test each get about
    the given fraction of the words, whole documents only. A document that would take a part
    past twice its share stays in training (one long table among paragraphs must not make
    validation a fifth of the corpus); a part that no document fits takes the smallest one."""
    import datasets  # noqa: PLC0415

    sizes = [len(t.split()) if t else 0 for t in ds["text"]]  # a row without text (null): an empty document
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    total = sum(sizes)
    parts: dict[str, list[int]] = {"validation": [], "test": []}
    taken = {"validation": 0, "test": 0}
    train = []
    for i in order:
        for name, frac in zip(("validation", "test"), fractions):
            if taken[name] < frac * total and taken[name] + sizes[i] <= 2 * frac * total:
                parts[name].append(i)
                taken[name] += sizes[i]
                break
        else:
            train.append(i)
    for name, frac in zip(("validation", "test"), fractions):
        if frac > 0 and not parts[name] and train:
            smallest = min(train, key=sizes.__getitem__)
            train.remove(smallest)
            parts[name].append(smallest)
    if not train or any(frac > 0 and not parts[name] for name, frac in zip(("validation", "test"), fractions)):
        raise ValueError(f"{len(ds)} document(s) cannot be split into train, validation and test by whole documents: "
                         "give more (data.sample_by=line makes each line of a text file one) or the splits "
                         "themselves (data.path={train: .., validation: .., test: ..})")
    return datasets.DatasetDict(
        train=ds.select(sorted(train)),
        validation=ds.select(sorted(parts["validation"])),
        test=ds.select(sorted(parts["test"])),
    )


def load_corpus(
    source: str = "embedded",
    *,
    path: str | list[str] | None = None,
    name: str | None = None,
    subset: str | None = None,
    text_column: str = "text",
    sample_by: str = "paragraph",
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    min_doc_tokens: int = 20,
    seed: int = 0,
) -> datasets.DatasetDict:
    """The corpus as a ``DatasetDict`` of documents with a ``text`` column.

    source: ``embedded`` (gensim's Wikipedia extract), ``files`` (local text files in
    ``path``, a file or directory or list; split by document when no split files are
    given), or ``hub`` (``load_dataset(name, subset)``, e.g. ``wikitext`` /
    ``wikitext-103-raw-v1`` or ``lm1b``).
    """
    import datasets  # noqa: PLC0415

    cache = str(cache_dir() / "datasets")
    if source == "embedded":
        from gensim.test.utils import datapath  # noqa: PLC0415

        wiki = datapath(EMBEDDED_WIKI)
        if not Path(wiki).is_file():
            raise FileNotFoundError(f"gensim's embedded corpus is missing: {wiki}")
        ds = datasets.Dataset.from_generator(
            _wiki_articles, gen_kwargs={"path": wiki, "min_tokens": min_doc_tokens}, cache_dir=cache
        )
        return _split_by_tokens(ds, (val_fraction, test_fraction), seed)
    if source == "files":
        return _load_files(path, sample_by, val_fraction, test_fraction, seed, cache)
    if source == "hub":
        return _load_hub(name, subset, path, text_column, (val_fraction, test_fraction), seed, cache)
    raise ValueError(f"data.source must be 'embedded', 'files' or 'hub', not {source!r}")


def _load_hub(name, subset, path, text_column, fractions, seed, cache) -> datasets.DatasetDict:
    """``load_dataset(name, subset)``: a hub name, a local folder of data files, or a builder with
    ``path`` as its ``data_files`` (``name=json path=corpus.jsonl``); a held-out split the
    dataset lacks is carved from train by document (``_carve_missing``: lm1b has no validation, one
    file no test)."""
    import datasets  # noqa: PLC0415

    if not name:
        raise ValueError("data.name must name a hub dataset when data.source=hub")
    try:
        dd = datasets.load_dataset(name, subset, data_files=path or None, cache_dir=cache)
    except ConnectionError as e:  # offline, or the hub unreachable, and nothing cached
        raise ConnectionError(
            f"data.name={name!r} (data.source=hub) is not cached and the Hugging Face hub cannot be reached "
            f"({e}): run once with the network to cache it in {cache}, or train offline on data=wiki "
            "(embedded) or data=text_files data.path=..."
        ) from e
    except FileNotFoundError as e:
        if not path:
            raise
        raise FileNotFoundError(f"data.path={path!r} (the data files of data.name={name!r}): {e}") from e
    except datasets.exceptions.DatasetGenerationError as e:  # a malformed file: the parser's error, one line
        where = f"data.name={name!r}" + (f" data.path={path!r}" if path else "")
        raise ValueError(f"{where}: datasets could not read it ({e.__cause__ or e})") from e
    if "train" not in dd:
        raise ValueError(f"hub dataset {name!r} has no train split (its splits: {sorted(dd)})")
    columns = dd["train"].features
    if text_column not in columns:
        raise ValueError(f"data.text_column={text_column!r} is not a column of {name!r}: name one of {list(columns)}")
    kind = getattr(columns[text_column], "dtype", type(columns[text_column]).__name__)
    text_types = ("string", "large_string")  # datasets' dtypes of text
    if kind not in text_types:
        raise ValueError(f"data.text_column={text_column!r} of {name!r} holds {kind} values, not text: name one of "
                         f"{[c for c, f in columns.items() if getattr(f, 'dtype', None) in text_types]}")
    if text_column != "text":
        dd = dd.select_columns([text_column]).rename_column(text_column, "text")
    dd = _carve_missing(dd, fractions, seed)
    return datasets.DatasetDict({s: dd[s].select_columns(["text"]) for s in SPLITS})


def _carve_missing(dd: datasets.DatasetDict, fractions: tuple[float, float], seed: int) -> datasets.DatasetDict:
    """``dd`` with the held-out splits it lacks carved from its train split by document; the splits
    it has kept as they are."""
    import datasets  # noqa: PLC0415

    missing = [s for s in SPLITS[1:] if s not in dd]
    if not missing:
        return dd
    carved = _split_by_tokens(dd["train"], tuple(f if s in missing else 0.0 for s, f in zip(SPLITS[1:], fractions)),
                              seed)
    return datasets.DatasetDict({s: carved[s] if s == "train" or s in missing else dd[s] for s in SPLITS})


def _load_files(path, sample_by, val_fraction, test_fraction, seed, cache) -> datasets.DatasetDict:
    import datasets  # noqa: PLC0415

    files = text_files(path)
    try:
        dd = datasets.load_dataset("text", data_files=files, sample_by=sample_by, cache_dir=cache)
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, UnicodeDecodeError):
            raise ValueError(f"data.path: {not_utf8(files)} is not UTF-8 text ({e.__cause__}): convert it, e.g. "
                             "iconv -f latin1 -t utf-8") from e
        raise
    dd = dd.filter(lambda r: bool(r["text"].strip()))
    return _carve_missing(dd, (val_fraction, test_fraction), seed)
