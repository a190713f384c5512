"""Shared by the tests of scripts/: the scripts import as modules (their folder on
``sys.path``, as when run as ``python scripts/<name>.py``), and the ``sandbox`` fixture."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from output_sandbox import Sandbox, make_sandbox  # noqa: E402  (it imports benchlib)


@pytest.fixture
def sandbox(tmp_path, monkeypatch) -> Sandbox:
    """A temporary current directory and a copy of benchmarks/results/ as $LST_RESULTS_DIR."""
    return make_sandbox(tmp_path, monkeypatch)
