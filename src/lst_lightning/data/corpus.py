"""Raw text corpora as HF ``datasets`` with ``train``/``validation``/``test`` splits of
documents (one ``text`` column), from the embedded Wikipedia extract, local files, or
the hub. Everything goes through ``datasets`` so caching and hub names share one path.
"""
from __future__ import annotations

import bz2
import os
import random
from pathlib import Path

import datasets

EMBEDDED_WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SPLITS = ("train", "validation", "test")


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
    the given fraction of the words, whole documents only."""
    sizes = [len(t.split()) for t in ds["text"]]
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    total = sum(sizes)
    parts: dict[str, list[int]] = {"validation": [], "test": []}
    taken = {"validation": 0, "test": 0}
    train = []
    for i in order:
        for name, frac in zip(("validation", "test"), fractions):
            if taken[name] < frac * total:
                parts[name].append(i)
                taken[name] += sizes[i]
                break
        else:
            train.append(i)
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
        if not name:
            raise ValueError("data.name must name a hub dataset when data.source=hub")
        dd = datasets.load_dataset(name, subset, cache_dir=cache)
        if text_column != "text":
            dd = dd.rename_column(text_column, "text")
        if "validation" not in dd and "train" in dd:
            # lm1b has no validation split: carve one from train by document.
            rest = _split_by_tokens(dd["train"], (val_fraction, 0.0), seed)
            dd = datasets.DatasetDict(train=rest["train"], validation=rest["validation"], test=dd["test"])
        missing = [s for s in SPLITS if s not in dd]
        if missing:
            raise ValueError(f"hub dataset {name!r} lacks the splits {missing}")
        return datasets.DatasetDict({s: dd[s].select_columns(["text"]) for s in SPLITS})
    raise ValueError(f"data.source must be 'embedded', 'files' or 'hub', not {source!r}")


def _load_files(path, sample_by, val_fraction, test_fraction, seed, cache) -> datasets.DatasetDict:
    if path is None:
        raise ValueError("data.path must name text files when data.source=files")
    if isinstance(path, dict):  # explicit {train: ..., validation: ..., test: ...}
        files = {k: [str(v)] if isinstance(v, str) else list(v) for k, v in path.items()}
    else:
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        found: list[str] = []
        for p in map(Path, paths):
            if p.is_dir():
                found += sorted(str(f) for f in p.rglob("*.txt"))
            elif p.is_file():
                found.append(str(p))
            else:
                raise FileNotFoundError(f"data file not found: {p}")
        files = {"train": found}
    for split, fs in files.items():
        if not fs:
            raise FileNotFoundError(f"no .txt files for split {split!r} in {path}")
        for f in fs:
            if not Path(f).is_file():
                raise FileNotFoundError(f"data file not found: {f}")
            if Path(f).stat().st_size == 0 or not Path(f).read_text(errors="replace").strip():
                raise ValueError(f"data file is empty: {f}")
    dd = datasets.load_dataset("text", data_files=files, sample_by=sample_by, cache_dir=cache)
    dd = dd.filter(lambda r: bool(r["text"].strip()))
    if set(SPLITS) <= set(dd):
        return dd
    return _split_by_tokens(dd["train"], (val_fraction, test_fraction), seed)
