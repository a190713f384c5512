"""A sandbox for the tests of scripts/ that checks their output policy: a default run
writes only its own run directory, ``--update-results`` writes only into the results
folder (a temporary copy of benchmarks/results/ here, as $LST_RESULTS_DIR)."""
from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import benchlib
import pytest

COMMITTED = benchlib.ROOT / "benchmarks" / "results"


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` -> the SHA-256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class Sandbox:
    cwd: Path       # the current directory of the runs
    results: Path   # $LST_RESULTS_DIR: where --update-results writes

    def run_default(self, main: Callable, argv: list[str], script: str) -> Path:
        """``main(argv)`` with no output option; asserts that neither the committed results nor
        their stand-in changed, and returns the one fresh run directory it wrote."""
        before = tree_hashes(COMMITTED), tree_hashes(self.results)
        assert main(argv) in (0, None)
        assert (tree_hashes(COMMITTED), tree_hashes(self.results)) == before
        (run_dir,) = (self.cwd / "outputs" / "bench" / script).iterdir()
        return run_dir

    def run_update(self, main: Callable, argv: list[str]) -> set[str]:
        """``main(argv + ["--update-results"])``; returns the files of the results folder it
        made or changed, having checked that it made no run directory."""
        before = tree_hashes(self.results)
        assert main([*argv, "--update-results"]) in (0, None)
        assert not (self.cwd / "outputs").exists()
        after = tree_hashes(self.results)
        assert before.keys() <= after.keys()
        return {name for name, digest in after.items() if before.get(name) != digest}


def make_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    results = tmp_path / "results"
    shutil.copytree(COMMITTED, results)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv(benchlib.RESULTS_ENV, str(results))
    monkeypatch.chdir(cwd)
    return Sandbox(cwd, results)
