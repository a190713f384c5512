"""The wheel: it ships the Hydra configs and no benchmark code, and its console entry
points work once installed in a fresh virtual environment, away from the checkout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("uv") is None, reason="builds the wheel with uv")]


def run(cmd: list, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(["uv", "build", "--wheel", "-o", out], cwd=ROOT)
    (path,) = out.glob("lst_lightning-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed and no dependencies downloaded: a .pth file
    puts this environment's site-packages (torch & co.) on its path. The .pth files in
    that folder, the editable install of src/ among them, are not processed from there."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", root], cwd=root.parent)
    python = root / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    (site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel], cwd=root)
    return root


def test_wheel_has_the_configs_and_no_benchmark_code(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "lst_lightning/conf/config.yaml" in names
    assert "lst_lightning/conf/loss/zloss.yaml" in names and "lst_lightning/conf/experiment/tiny.yaml" in names
    assert any(n.startswith("lst_kernels/") for n in names)
    assert not [n for n in names if "bench" in n.split("/")[-1] or n.startswith(("scripts/", "benchmarks/"))]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert all(f"{c} =" in scripts for c in ("lst-train", "lst-compare", "lst-dashboard"))
    assert "lst-bench-head" not in scripts


def test_installed_lst_train_runs_from_the_wheel(venv, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    where = run([venv / "bin" / "python", "-c",
                 "import lst_lightning, lst_lightning.app.configs as c; print(lst_lightning.__file__); "
                 "print(c.config_dir())"], cwd=cwd).split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    # lst-train runs on that interpreter, so on that import path.
    assert (venv / "bin" / "lst-train").read_text().splitlines()[0] == f"#!{venv / 'bin' / 'python'}"
    run_dir = tmp_path / "run"
    run([venv / "bin" / "lst-train", "experiment=tiny", "logger=csv", "callbacks=minimal",
         f"hydra.run.dir={run_dir}"], cwd=cwd)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["train_steps"] > 0 and "mrr" in results["test"]
    assert not (cwd / "outputs").exists()


def test_installed_report_commands_answer_help(venv, tmp_path):
    for command in ("lst-compare", "lst-dashboard"):
        assert command in run([venv / "bin" / command, "--help"], cwd=tmp_path)
