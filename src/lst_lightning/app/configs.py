"""Where the Hydra configs are, ready to compose: the schemas that ``conf/head``,
``conf/model`` and ``conf/loss`` extend (the code's signatures, ``schemas.py``) registered
first where Hydra is installed. Without Lightning."""
from __future__ import annotations

from pathlib import Path


def config_dir() -> str:
    """``conf/`` inside the installed package (wheel), else at the repository root
    (editable install); the heads' and losses' schemas registered in Hydra's ConfigStore."""
    try:
        import hydra  # noqa: F401, PLC0415
    except ImportError:
        pass  # read as files only (the benchmark scripts): nothing composes, no schema is needed
    else:
        from .schemas import register  # noqa: PLC0415  (the heads: torch)

        register()
    package = Path(__file__).resolve().parents[1]  # src/lst_lightning (or site-packages/lst_lightning)
    for cand in (package / "conf", package.parents[1] / "conf"):
        if (cand / "config.yaml").is_file():
            return str(cand)
    raise FileNotFoundError(f"lst-lightning's conf/ directory not found near {package}")
