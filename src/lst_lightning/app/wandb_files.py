"""W&B's offline run files (``<run dir>/wandb/offline-run-*/run-*.wandb``), read with
W&B's own reader: ``wandb leet inspect --json`` (wandb-core's reader of the transaction
log; ``--summary`` gives the run's merged config and summary, plain ``--json`` one
record per line, of which we keep the history rows).

The W&B CLI's own argument builder is used to start wandb-core directly: through the
CLI itself every file costs a Python start and a W&B import (about 3 s here against
20 ms), which a sweep of 25 runs would feel. Should W&B move those helpers, the CLI is
used instead."""
from __future__ import annotations

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
        d = self.file.parent
        return d.parent.parent if d.parent.name == "wandb" else d

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
