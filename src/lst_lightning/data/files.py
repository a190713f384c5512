"""The local text files that ``data.path`` names, found and checked with pathlib only
(no ``datasets``), so that ``lst-train`` answers a wrong path before its heavy imports."""
from __future__ import annotations

import glob
from pathlib import Path

HOW = ("give a text file, a directory of .txt files, a glob ('docs/**/*.md'), a list of them, or "
       "{train: .., validation: .., test: ..}")


def _has_text(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether the file holds anything but whitespace (read until the first such byte)."""
    with path.open("rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return True
    return False


def _check(f: Path) -> str:
    if not f.is_file():
        raise FileNotFoundError(f"data.path: {f} not found; {HOW}")
    if not _has_text(f):
        raise ValueError(f"data.path: {f} is empty; give files with text in them")
    return str(f)


def _expand(p: Path) -> list[Path]:
    """A directory's ``*.txt`` (recursively), a glob's matches (``**`` recursive), or the path itself;
    sorted."""
    if p.is_dir():
        txt = sorted(p.rglob("*.txt"))
        if not txt:
            raise FileNotFoundError(f"data.path: the directory {p} holds no .txt files; {HOW}")
        return txt
    if not p.exists() and any(c in str(p) for c in "*?["):
        matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not matches:
            raise FileNotFoundError(f"data.path: the pattern {p} matches no file; {HOW}")
        return matches
    return [p]


def _files(paths) -> list[str]:
    """The checked files that ``paths`` name (``_expand``, then ``_check``), in their order."""
    return [_check(f) for p in paths for f in _expand(Path(p))]


def text_files(path) -> dict[str, list[str]]:
    """``data.path`` -> ``{split: [files]}``: ``{"train": [...]}`` for a file, a directory
    (its ``*.txt``, recursively), a glob or a list of them; the given splits for a mapping (each
    a file, a directory, a glob or a list; train among them). Raises FileNotFoundError for a missing path, a
    directory without .txt files or a glob matching none, ValueError for an empty file or a split other than
    train, validation and test, each naming ``data.path``."""
    if path is None or path == "":
        raise ValueError(f"data.path is not set: {HOW} (data=text_files data.path=my.txt)")
    if isinstance(path, dict):
        if "train" not in path or not set(path) <= {"train", "validation", "test"}:
            raise ValueError(f"data.path's splits are train (needed), validation and test, got {sorted(path)}; "
                             "a held-out split not given is carved from train")
        given = {split: [p] if isinstance(p, (str, Path)) else list(p) for split, p in path.items()}
        for split, ps in given.items():
            if not ps:
                raise FileNotFoundError(f"data.path.{split} names no files; {HOW}")
        return {split: _files(ps) for split, ps in given.items()}
    return {"train": _files([path] if isinstance(path, (str, Path)) else list(path))}


def not_utf8(files: dict[str, list[str]], chunk: int = 1 << 20) -> str | None:
    """The first of ``files`` (``text_files``' splits) that is not UTF-8 text, or None."""
    import codecs  # noqa: PLC0415

    for f in (f for fs in files.values() for f in fs):
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(f, "rb") as fh:
                while block := fh.read(chunk):
                    decoder.decode(block)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f
    return None
