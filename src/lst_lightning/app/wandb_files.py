"""W&B's offline run files (``<run dir>/wandb/offline-run-*/run-*.wandb``), read with
W&B's own reader: ``wandb leet inspect --json`` (wandb-core's reader of the transaction
log; ``--summary`` gives the run's merged config and summary, plain ``--json`` one
record per line, of which we keep the history rows).

The W&B CLI's own argument builder is used to start wandb-core directly: through the
CLI itself every file costs a Python start and a W&B import (about 3 s here against
20 ms), which a sweep of 25 runs would feel. Should W&B move those helpers, the CLI is
used instead."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WandbRun:
    """One W&B run as its transaction log holds it."""

    file: Path
    run_id: str
    name: str
    group: str
    project: str
    entity: str
    state: str
    tags: list[str]
    config: dict  # flat, as logged
    summary: dict
    history: list[dict] = field(default_factory=list)  # the history rows, in order

    @property
    def run_dir(self) -> Path:
        """The lst-train run directory that holds this W&B run (``<run dir>/wandb/<run>/``),
        or the W&B run's own directory when it lies elsewhere."""
        return run_dir_of(self.file)

    def keys(self) -> dict[str, set[str]]:
        """What the run logged: ``{"config": ..., "summary": ..., "history": ...}``."""
        return {"config": set(self.config), "summary": set(self.summary),
                "history": set().union(*self.history) if self.history else set()}


def find_run_files(root: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file under ``root`` (or ``root`` itself), once each."""
    root = Path(root)
    if root.is_file():
        return [root] if root.suffix == ".wandb" else []
    found = {p.resolve() for p in root.rglob("run-*.wandb") if p.parent.name.startswith(("offline-run-", "run-"))}
    return sorted(found)


def _inspect(path: Path, *flags: str) -> str:
    try:
        from wandb.cli import leet  # noqa: PLC0415

        args = [*leet._base_args("inspect"), *flags,
                *leet._get_local_launch_args(leet.LocalLaunchConfig(str(path.parent.parent), str(path)))]
    except Exception:  # moved helpers, or no wandb-core here: the CLI says what is wrong
        args = [sys.executable, "-m", "wandb", "leet", "inspect", *flags, str(path)]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ValueError(f"W&B could not read {path} (`wandb leet inspect {' '.join(flags)}`, wandb >= 0.31): "
                         f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    return proc.stdout


def run_dir_of(file: Path) -> Path:
    """``WandbRun.run_dir`` of a run file."""
    d = Path(file).parent
    return d.parent.parent if d.parent.name == "wandb" else d


def by_run_dir(files: list[Path]) -> dict[Path, list[Path]]:
    """``files`` (``find_run_files``'s, in the order their runs started) by the run directory
    holding them: an lst-train run resumed from its checkpoints writes one part a resume."""
    groups: dict[Path, list[Path]] = {}
    for f in files:
        groups.setdefault(run_dir_of(f).resolve(), []).append(f)
    return groups


def read_parts(files: list[Path], step_key: str) -> WandbRun:
    """One run logged in parts (``files``, in the order they were written: each resume of an
    lst-train run continues its W&B run in a new offline part): the last part's name, config
    and summary, and the history of all of them, each part's rows up to the step (``step_key``)
    the next part logged first: the steps a resume took again are the later part's."""
    parts = [read_run(f) for f in files]
    history = []
    for part, later in zip(parts, [*parts[1:], None]):
        start = None if later is None else min(
            (r[step_key] for r in later.history if r.get(step_key) is not None), default=None)
        history += [r for r in part.history if start is None or r.get(step_key) is None or r[step_key] < start]
    return dataclasses.replace(parts[-1], history=history)


def newest_run_id(run_dir: str | Path) -> str | None:
    """The id of the newest W&B run of an lst-train run directory (``<run_dir>/wandb/[offline-]run-<date>_<time>-<id>/
    run-<id>.wandb``, by its start time, then by when it was last written), or None where it holds none."""
    files = [p for p in (Path(run_dir) / "wandb").glob("*run-*/run-*.wandb") if p.is_file()]
    if not files:
        return None
    newest = max(files, key=lambda p: (p.parent.name.rsplit("-", 2)[-2], p.stat().st_mtime_ns))
    return newest.stem.removeprefix("run-")


def read_run(path: str | Path) -> WandbRun:
    """One ``run-*.wandb`` file (or the W&B run directory holding it)."""
    path = Path(path)
    if path.is_dir():
        files = find_run_files(path)
        if len(files) != 1:
            raise ValueError(f"{path} holds {len(files)} W&B run files, not one")
        path = files[0]
    if not path.is_file():
        raise FileNotFoundError(f"no such W&B run file: {path}")
    merged = json.loads(_inspect(path, "--summary", "--json"))
    records = [json.loads(line) for line in _inspect(path, "--json").splitlines() if line.strip()]
    run = next((r["run"] for r in records if r.get("type") == "run"), {})
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    return WandbRun(
        file=path, run_id=merged.get("run_id") or run.get("run_id", ""), name=merged.get("name") or "",
        group=run.get("run_group", ""), project=merged.get("project") or run.get("project", ""),
        entity=merged.get("entity") or "", state=merged.get("state", ""), tags=list(merged.get("tags") or []),
        config={k: v for k, v in (merged.get("config") or {}).items() if k != "_wandb"},
        summary=dict(merged.get("summary") or {}), history=history)


def read_runs(root: str | Path) -> list[WandbRun]:
    return [read_run(p) for p in find_run_files(root)]
