"""The code corpora (sources.py): data=python_code from the packages uv.lock pins, and
data=linux_source streamed out of Debian's linux-source-6.1 tarball, with their token and
type counts. The fast tests take a prefix of 2 x 10^5 tokens; the full counts are slow
(`-m slow`). The tarball is not in CI's fresh machine: its tests skip there, and the
tarball's reading is tested on a small one made here."""
import platform
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from lst_lightning.data import TextDataModule
from lst_lightning.data import sources as sources_module
from lst_lightning.data.corpus import SPLITS
from lst_lightning.data.sources import LINUX_TARBALL, LinuxSource, PythonCode, find_uv_lock, split_of
from lst_lightning.data.tokens import tokenise

LINUX = pytest.mark.skipif(not Path(LINUX_TARBALL).is_file(),
                           reason=f"{LINUX_TARBALL} is not installed (apt-get install linux-source-6.1)")
PREFIX = 200_000
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LST_CACHE_DIR", str(tmp_path / "cache"))


def _counts(tok):
    m = tok.meta
    return sum(m["documents"].values()), sum(m["tokens"].values()), m["types"], tok.train_types


def _splits_by_file(names_by_split):
    for a in SPLITS:
        for b in SPLITS:
            assert a == b or not names_by_split[a] & names_by_split[b]


def test_files_split_by_their_names_alone():
    names = [f"pkg/mod{i}.py" for i in range(4000)]
    split = [split_of(n, 0.05, 0.1) for n in names]
    assert split == [split_of(n, 0.05, 0.1) for n in reversed(names)][::-1]  # no order, no state
    share = {s: split.count(s) / len(names) for s in SPLITS}
    assert abs(share["validation"] - 0.05) < 0.015 and abs(share["test"] - 0.1) < 0.02


def test_python_code_is_the_locked_packages_files():
    src = PythonCode(None, 0.05, 0.05)
    assert src.lock == find_uv_lock() and src.lock.name == "uv.lock"
    names = [n for n, _ in src.files()]
    packages = {n.split("/")[0] for n in names}
    assert {"torch", "numpy", "lightning", "datasets"} <= packages and "lst-lightning" not in packages
    assert len(names) == len(set(names)) > 5_000 and all(n.endswith(".py") for n in names)
    assert names[:5] != sorted(names)[:5]  # drawn across the packages, not alphabetical
    with pytest.raises(FileNotFoundError, match="data.path: .* not found; give the uv.lock"):
        PythonCode("/nonexistent/uv.lock", 0.05, 0.05)


def _installed(root: Path, version: str, files: dict[str, str]) -> None:
    """A distribution ``shadowed`` of ``version`` installed into ``root``: its files and a dist-info."""
    info = root / f"shadowed-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: shadowed\nVersion: {version}\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in files))


def test_python_code_takes_a_distribution_installed_twice_once(tmp_path, monkeypatch):
    """Two installs of one distribution on sys.path (an overlay, as ``uv run --with`` makes): the
    files of the first, the one that imports, and none of the one it shadows."""
    first, second = tmp_path / "overlay", tmp_path / "base"
    _installed(first, "2.0", {"shadowed/a.py": "x = 2\n", "shadowed/new.py": "y = 2\n"})
    _installed(second, "1.0", {"shadowed/a.py": "x = 1\n", "shadowed/old.py": "y = 1\n"})
    lock = tmp_path / "uv.lock"
    lock.write_text('version = 1\n[[package]]\nname = "shadowed"\nversion = "2.0"\n')
    monkeypatch.setattr("sys.path", [str(first), str(second)])
    files = PythonCode(str(lock), 0.05, 0.05).files()
    assert sorted(name for name, _ in files) == ["shadowed/shadowed/a.py", "shadowed/shadowed/new.py"]
    assert {path.parent.parent for _, path in files} == {first}


def test_python_code_prefix_counts(cache):
    """2 x 10^5 tokens of the Python files: documents, tokens, types, split by file."""
    src = PythonCode(None, 0.05, 0.05)
    tok = tokenise(src, "code", PREFIX)
    docs, tokens, types, train_types = _counts(tok)
    largest_file = max(p.stat().st_size for _, p in src.files()[:docs + 1])
    assert PREFIX <= tokens < PREFIX + largest_file and tok.meta["capped"]
    assert 20 < docs < 2_000 and 10_000 < types < 60_000 and 0.8 * types < train_types < types
    for s in SPLITS:
        assert tok.ids(s).dtype == np.int32 and len(tok.ids(s)) == tok.offsets(s)[-1] == tok.meta["tokens"][s] > 0



def test_python_code_is_cached_once_for_every_checkout_of_the_same_pins(tmp_path, monkeypatch):
    """The cache's key is the files the lock picked, not the lock's place: a second checkout (a
    clone, a worktree) reads the first one's tokens; another set of pins is another corpus."""
    first, second, other = tmp_path / "a" / "uv.lock", tmp_path / "b" / "uv.lock", tmp_path / "c" / "uv.lock"
    _installed(tmp_path / "site", "2.0", {"shadowed/a.py": "x = 2\n"})
    _installed(tmp_path / "site2", "1.0", {"other/b.py": "y = 1\n"})
    (tmp_path / "site2" / "shadowed-1.0.dist-info").rename(tmp_path / "site2" / "other-1.0.dist-info")
    (tmp_path / "site2" / "other-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: other\n")
    for lock, name in ((first, "shadowed"), (second, "shadowed"), (other, "other")):
        lock.parent.mkdir()
        lock.write_text(f'version = 1\n[[package]]\nname = "{name}"\nversion = "1.0"\n')
    monkeypatch.setattr("sys.path", [str(tmp_path / "site"), str(tmp_path / "site2")])
    keys = [PythonCode(str(lock), 0.05, 0.05).key() for lock in (first, second, other)]
    assert keys[0] == keys[1] != keys[2]

@pytest.mark.slow
def test_python_code_full_counts(cache):
    """data=python_code as configured (2 x 10^7 tokens, D = 10^5) and whole (about 6 x 10^7
    tokens, 7 x 10^5 types); the uv.lock's pins, measured on Python 3.11, Linux x86-64."""
    dm = TextDataModule("python_code", tokenizer="code", vocab_size=100_000, max_tokens=20_000_000)
    dm.prepare_data()
    docs, tokens, types, train_types = _counts(dm.tokenised)
    assert 20_000_000 <= tokens < 20_100_000 and 4_000 < docs < 8_000 and 250_000 < train_types < types < 400_000
    assert 0.01 < sum(dm.tokenised.unknown(s, dm.vocab) for s in SPLITS) / tokens < 0.04
    whole = tokenise(dm.source, "code")
    whole_counts = _counts(whole)
    assert 4.5e7 < whole_counts[1] < 8e7 and 5e5 < whole_counts[2] < 1e6 and 12_000 < whole_counts[0] < 25_000
    assert not whole.meta["capped"]
    if sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64":
        # docs/corpora.md's table is measured there: its counts are these
        table = (ROOT / "docs" / "corpora.md").read_text()
        for label, (d, _, t, tt) in (("2 x 10^7 (`data=python_code`)", (docs, tokens, types, train_types)),
                                     ("all of them (`data.max_tokens=null`)", whole_counts)):
            row = f"| {label} | {d:,} | {t:,} ({tt:,}) |".replace(",", " ")
            assert row in table, row


def _tarball(tmp_path):
    """A small kernel-like tarball: C files under a top directory, and files that are not C."""
    root = tmp_path / "linux-source-6.1"
    for i in range(40):
        f = root / "drivers" / f"d{i}.c"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"static int probe_{i}(struct device *dev)\n{{\n\treturn dev->id + 0x{i:x};\n}}\n")
    (root / "include" / "x.h").parent.mkdir(parents=True)
    (root / "include" / "x.h").write_text("#define X_MAX 42UL\n")
    (root / "Makefile").write_text("obj-y += never_read.o\n")
    path = tmp_path / "linux.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        tar.add(root, arcname=root.name)
    return path


def test_linux_source_streams_the_c_files_of_a_tarball(tmp_path, cache):
    path = _tarball(tmp_path)
    src = LinuxSource(str(path), 0.2, 0.2)
    docs = list(src.documents())
    assert len(docs) == 41 and sum(d[2] for d in docs) <= path.stat().st_size
    assert not any("never_read" in text for _, text, _ in docs)
    dm = TextDataModule("linux_source", path=str(path), tokenizer="code", vocab_size=None, context_size=2,
                        val_fraction=0.2, test_fraction=0.2)
    dm.prepare_data()
    dm.setup()
    assert dm.tokenised.meta["tokens"]["train"] + dm.tokenised.meta["tokens"]["validation"] > 0
    assert {"probe_0", "dev", "-", ">", "0x0", "X_MAX", "42UL"} <= set(dm.tokenised.types())
    assert sum(dm.tokenised.meta["documents"].values()) == 41 and len(dm.splits["train"]) > 0
    capped = tokenise(src, "code", 300)  # whole files of 19 tokens
    assert 300 <= sum(capped.meta["tokens"].values()) < 319 and capped.meta["capped"]


def test_linux_source_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "LINUX_TARBALL", str(tmp_path / "linux-source-6.1.tar.xz"))
    with pytest.raises(FileNotFoundError) as e:
        TextDataModule("linux_source", tokenizer="code")
    assert "apt-get install linux-source-6.1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="give the path of a linux-source .tar.xz"):
        TextDataModule("linux_source", path=str(tmp_path / "other.tar.xz"))


@LINUX
def test_linux_source_prefix_counts(cache):
    """The tarball's first 2 x 10^5 C tokens (linux-source-6.1 6.1.192-3)."""
    tok = tokenise(LinuxSource(None, 0.05, 0.05), "code", PREFIX)
    docs, tokens, types, _ = _counts(tok)
    assert PREFIX <= tokens < PREFIX + 100_000 and 50 < docs < 500 and 10_000 < types < 40_000


@LINUX
@pytest.mark.slow
def test_linux_source_full_counts(cache):
    """data=linux_source as configured: 4 x 10^7 tokens whose training split holds more
    than 10^6 types, so data.vocab_size=10^6 is valid."""
    dm = TextDataModule("linux_source", tokenizer="code", vocab_size=1_000_000, max_tokens=40_000_000)
    dm.prepare_data()
    docs, tokens, types, train_types = _counts(dm.tokenised)
    assert 4e7 <= tokens < 4.1e7 and 10_000 < docs < 25_000 and 1_000_000 < train_types < types < 3e6
