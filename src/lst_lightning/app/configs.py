"""Where the Hydra configs are, found without importing Hydra or Lightning (the
benchmark scripts read ``conf/loss`` on machines that have neither)."""
from __future__ import annotations

from pathlib import Path


def config_dir() -> str:
    """``conf/`` inside the installed package (wheel), else at the repository root
    (editable install)."""
    package = Path(__file__).resolve().parents[1]  # src/lst_lightning (or site-packages/lst_lightning)
    for cand in (package / "conf", package.parents[1] / "conf"):
        if (cand / "config.yaml").is_file():
            return str(cand)
    raise FileNotFoundError(f"lst-lightning's conf/ directory not found near {package}")
