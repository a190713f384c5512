"""The folder of a fixture of the whole test run, made once, whatever the number of pytest-xdist
workers: the first worker to ask makes it under a file lock, the others wait and use it. For
fixtures that spawn processes (a two-rank run, an lst-train sweep), which every worker whose
files need them would otherwise make again."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

DONE = ".made"


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name`` shared by this run's workers, filled by ``make(folder)`` once. A
    ``make`` that raises leaves no mark: the next worker to ask makes it again (and fails alike)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: a base per worker, one parent
    folder = shared / f"once-{name}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / DONE).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a make that raised left
            folder.mkdir()
            make(folder)
            (folder / DONE).touch()
    return folder
