"""Checkpoints of a sharded V as one file per rank, for D too large to gather.

A save writes ``<root>/step<N>/rank<r>.pt`` = {"rows": (lo, hi), "V": rows lo:hi}
from every rank; the Lightning checkpoint keeps only the directory's name. A load
reads any row range from the files (memory-mapped: only the rows asked for are
read), so a run resumes on another number of ranks or in one process.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

#: how a sharded V goes into checkpoints: whole (gathered on rank 0) or per_rank (these files)
CHECKPOINT_MODES = ("whole", "per_rank")


def check_checkpoint_settings(mode, keep) -> None:
    """``head_checkpoint`` (a mode of ``CHECKPOINT_MODES``) and ``head_shards_keep`` (the saves
    whose shards are kept, a whole number >= 1): one ValueError naming the setting."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"head_checkpoint={mode!r}: must be {' or '.join(CHECKPOINT_MODES)}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"head_shards_keep={keep!r}: must be a whole number >= 1")


def shard_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its rows in a save's directory."""
    return Path(directory) / f"rank{rank:05d}.pt"


def save_shard(directory: str | Path, rank: int, rows: tuple[int, int], V: Tensor,
               save: Callable[[object, Path], None] = torch.save) -> Path:
    """Rows ``rows`` of V (``V`` holds them) as rank ``rank``'s file; ``save(obj, path)`` writes it
    (the app's ``atomic_torch_save``: beside its name, synced, renamed, so a kill mid-write never
    leaves a half file under the final name)."""
    path = shard_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save({"rows": tuple(rows), "V": V.detach().cpu()}, path)
    return path


def load_rows(directory: str | Path, lo: int = 0, hi: int | None = None) -> Tensor:
    """Rows lo:hi of V (hi None: to the last) assembled from the shard files in ``directory``."""
    files = sorted(Path(directory).glob("rank*.pt"))
    if not files:
        raise FileNotFoundError(f"no shard files (rank*.pt) in {directory}: the checkpoint's head "
                                "shards were moved or deleted")
    parts = [torch.load(f, mmap=True, weights_only=True) for f in files]
    hi = max(part["rows"][1] for part in parts) if hi is None else hi
    out, covered = None, 0
    for part in parts:
        a, b = part["rows"]
        s, e = max(a, lo), min(b, hi)
        if s >= e:
            continue
        if out is None:
            out = torch.empty(hi - lo, part["V"].shape[1], dtype=part["V"].dtype)
        out[s - lo:e - lo] = part["V"][s - a:e - a]
        covered += e - s
    if covered != hi - lo:
        raise ValueError(f"the shard files in {directory} cover {covered} of the rows {lo}:{hi} asked for")
    return out


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` step directories under ``root``."""
    steps = sorted(Path(root).glob("step*"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else -1)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
