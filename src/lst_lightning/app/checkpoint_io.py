"""Checkpoint files replaced atomically, in their own directory.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction: on a local path
fsspec writes the whole file to the system's temporary directory, then ``shutil.move``\\ s
it into place, which is a rename only when both are on one file system. Run directories
usually are not on /tmp's (a cluster's shared disk, /tmp node-local and small): the move
becomes a copy into the final name, and a kill during it leaves a truncated
``last.ckpt``. Here the file is written next to its final name, synced, and renamed over
it (``os.replace``): a reader sees the old file or the new one, never part of one. Other
file systems (s3://, ...) keep Lightning's way.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a temporary file beside ``path``, synced, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the write failed
    sync_directory(path.parent)


def link_atomically(source: str | Path, path: str | Path) -> bool:
    """``path`` becomes a hard link to ``source`` (one copy on disk, none written), replacing
    the old ``path`` by a rename; False, and nothing changed, where the file system has no
    hard links."""
    source, path = Path(source), Path(path)
    tmp = path.with_name(f".{path.name}.link{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        return False
    os.replace(tmp, path)
    sync_directory(path.parent)
    return True


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(str(path)):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, path)
