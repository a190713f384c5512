"""The files ``lst-train`` writes into a run directory, read back by ``lst-compare`` and
``lst-dashboard``: ``results.json`` and ``config.yaml``, each a mapping. A file that does not
parse (cut short, edited by hand) or holds no mapping is refused in one line naming it."""
from __future__ import annotations

import json
from pathlib import Path

import yaml


def _mapping(path: Path, parse) -> dict:
    try:
        data = parse(path.read_text())
    except (ValueError, yaml.YAMLError) as e:  # json's errors and a text that is no UTF-8 are ValueErrors
        mark = getattr(e, "problem_mark", None)
        why = f"{e.problem}: line {mark.line + 1}, column {mark.column + 1}" if mark else str(e)
        raise ValueError(f"{path} does not parse: {' '.join(why.split())}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a mapping: not a file lst-train wrote")
    return data


def read_results(path: str | Path) -> dict:
    """A run's ``results.json``."""
    return _mapping(Path(path), json.loads)


def read_config(path: str | Path) -> dict:
    """A run's ``config.yaml`` (an empty file: {})."""
    return _mapping(Path(path), lambda text: yaml.safe_load(text) or {})
