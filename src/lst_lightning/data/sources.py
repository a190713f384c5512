"""Where a corpus's documents come from, for the tokeniser (tokens.py): each source says
what identifies its documents (``key``: the files and the settings, cheap to compute, so
that a cached tokenisation is found without reading the text) and hands out its
documents as ``(split, text)`` in a fixed order.

- ``CorpusSource``: the ``datasets`` corpora of corpus.py (the embedded Wikipedia
  extract, local text files, the hub), split as ``load_corpus`` splits them.
- ``PythonCode``: the Python files of the packages ``uv.lock`` pins, as installed in this
  environment (``data=python_code``).
- ``LinuxSource``: the C sources of the Linux kernel in Debian's ``linux-source-6.1``
  package, streamed out of its ``.tar.xz`` (``data=linux_source``).

The two code corpora are split by file, from a hash of each file's name: a file's split
does not depend on the seed, nor on which other files are there.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

from .corpus import SPLIT_RULE, SPLITS, load_corpus
from .files import text_files

LINUX_TARBALL = "/usr/src/linux-source-6.1.tar.xz"
LINUX_INSTALL = "apt-get install linux-source-6.1"
LINUX_SUFFIXES = (".c", ".h")


def _unit(name: str, salt: str) -> float:
    """A number in [0, 1) from ``name`` alone (the same on every machine and run)."""
    return int.from_bytes(hashlib.blake2b(f"{salt}:{name}".encode(), digest_size=8).digest(), "big") / 2.0**64


def split_of(name: str, val_fraction: float, test_fraction: float) -> str:
    """The split of the file ``name``: validation and test each take about their fraction of the files."""
    u = _unit(name, "split")
    return "validation" if u < val_fraction else "test" if u < val_fraction + test_fraction else "train"


def _stat(path: str | Path) -> list:
    s = os.stat(path)
    return [str(path), s.st_size, s.st_mtime_ns]


class CorpusSource:
    """A corpus of corpus.py (``data.source``: embedded, files, hub)."""

    unit = "documents"

    def __init__(self, corpus_args: dict):
        self.args = corpus_args
        self.name = corpus_args["source"]
        self._corpus = None

    def _load(self):
        if self._corpus is None:
            self._corpus = load_corpus(**self.args)
        return self._corpus

    def key(self) -> dict:
        source = self.args["source"]
        if source == "embedded":
            from gensim.test.utils import datapath  # noqa: PLC0415

            from .corpus import EMBEDDED_WIKI  # noqa: PLC0415

            what = [_stat(datapath(EMBEDDED_WIKI))]
        elif source == "files":
            what = {split: [_stat(f) for f in fs] for split, fs in text_files(self.args["path"]).items()}
        else:  # the hub: what datasets cached, by its fingerprints
            what = {split: ds._fingerprint for split, ds in self._load().items()}
        return {"args": {k: v for k, v in self.args.items() if k != "path"}, "what": what, "split": SPLIT_RULE}

    def size(self) -> int:
        return sum(len(ds) for ds in self._load().values())

    def documents(self) -> Iterator[tuple[str, str, int]]:
        """``(split, text, progress)``: progress counts documents."""
        for split in SPLITS:
            for batch in self._load()[split].iter(batch_size=1000):
                for text in batch["text"]:
                    yield split, text or "", 1  # a row without text (null): an empty document


def _pinned(lock: Path) -> tuple[set[str], set[str]]:
    """The package names ``uv.lock`` pins, and those it installs from the project itself."""
    try:
        import tomllib  # noqa: PLC0415
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # noqa: PLC0415
    packages = tomllib.loads(lock.read_text())["package"]
    own = {p["name"] for p in packages if set(p.get("source", {})) & {"editable", "virtual"}}
    return {p["name"] for p in packages}, own


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_uv_lock() -> Path | None:
    """The project's ``uv.lock``: beside the checkout this package runs from, else in the
    working directory; None when neither has one (an installed wheel)."""
    here = Path(__file__).resolve()
    for place in [*here.parents[3:4], Path.cwd()]:
        if (place / "uv.lock").is_file():
            return place / "uv.lock"
    return None


class PythonCode:
    """The ``.py`` files of the installed distributions that ``uv.lock`` pins (every
    installed one where there is no lock; never the project's own; of a distribution installed
    twice on ``sys.path``, as under ``uv run --with``, the one that imports), each file one
    document, named ``<distribution>/<path in it>``. Files are read in an order drawn
    from their names, so a prefix (``data.max_tokens``) samples every package."""

    name = "python_code"
    unit = "bytes"

    def __init__(self, lock: str | None, val_fraction: float, test_fraction: float):
        if lock is not None and not Path(lock).is_file():
            raise FileNotFoundError(f"data.path: {lock} not found; give the uv.lock that pins the packages, "
                                    "or null for the project's own")
        self.lock = Path(lock) if lock is not None else find_uv_lock()
        self.fractions = (val_fraction, test_fraction)
        self._files: list[tuple[str, Path]] | None = None

    def files(self) -> list[tuple[str, Path]]:
        """``(name, path)`` of every file, in reading order."""
        if self._files is None:
            pinned, own = _pinned(self.lock) if self.lock is not None else (None, set())
            found: dict[str, tuple[str, Path]] = {}
            taken: set[str] = set()
            for dist in importlib.metadata.distributions():
                dist_name = _normal(dist.metadata["Name"] or "")
                if dist_name in own or dist_name in taken or (pinned is not None and dist_name not in pinned):
                    continue  # a name found again further along sys.path is shadowed: the first one imports
                taken.add(dist_name)
                for f in dist.files or ():
                    if f.suffix == ".py":
                        path = Path(dist.locate_file(f))
                        if path.is_file():  # RECORD may list what is not there
                            found.setdefault(str(path), (f"{dist_name}/{f.as_posix()}", path))
            self._files = sorted(found.values(), key=lambda nf: _unit(nf[0], "order"))
            if not self._files:
                raise FileNotFoundError(f"data=python_code found no installed Python files of the packages in "
                                        f"{self.lock or 'this environment'}")
        return self._files

    def key(self) -> dict:
        """What the tokens depend on: each file's name, size and time, and the splits; not where
        the lock lies (the files it picked are here), so every checkout of the same pins shares
        one cache."""
        return {"fractions": self.fractions, "files": [[name, *_stat(path)[1:]] for name, path in self.files()]}

    def size(self) -> int:
        return sum(path.stat().st_size for _, path in self.files())

    def documents(self) -> Iterator[tuple[str, str, int]]:
        """``(split, text, progress)``: progress counts bytes."""
        for name, path in self.files():
            data = path.read_bytes()
            yield split_of(name, *self.fractions), data.decode("utf-8", "replace"), len(data)


class LinuxSource:
    """The ``.c`` and ``.h`` files of the Linux kernel's sources, read in the tarball's
    order without unpacking it, each file one document."""

    name = "linux_source"
    unit = "bytes"

    def __init__(self, tarball: str | None, val_fraction: float, test_fraction: float):
        self.tarball = Path(tarball or LINUX_TARBALL)
        if not self.tarball.is_file():
            how = f"install it with `{LINUX_INSTALL}` (as root, after apt-get update)" if tarball is None else \
                "give the path of a linux-source .tar.xz, or null for Debian's"
            raise FileNotFoundError(f"data=linux_source: {self.tarball} not found; {how}")
        self.fractions = (val_fraction, test_fraction)

    def key(self) -> dict:
        return {"tarball": _stat(self.tarball), "suffixes": LINUX_SUFFIXES, "fractions": self.fractions}

    def size(self) -> int:
        return self.tarball.stat().st_size

    def documents(self) -> Iterator[tuple[str, str, int]]:
        """``(split, text, progress)``: progress counts the compressed bytes read."""
        with self.tarball.open("rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            read = 0
            for member in tar:
                if member.isfile() and member.name.endswith(LINUX_SUFFIXES):
                    name = member.name.split("/", 1)[-1]  # without the top directory
                    text = tar.extractfile(member).read().decode("utf-8", "replace")
                    yield split_of(name, *self.fractions), text, raw.tell() - read
                    read = raw.tell()

