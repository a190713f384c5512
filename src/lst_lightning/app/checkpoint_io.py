"""Checkpoint files replaced atomically, in their own directory.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction: on a local path
fsspec writes the whole file to the system's temporary directory, then ``shutil.move``\\ s
it into place, which is a rename only when both are on one file system. Run directories
usually are not on /tmp's (a cluster's shared disk, /tmp node-local and small): the move
becomes a copy into the final name, and a kill during it leaves a truncated
``last.ckpt``. Here the file is written next to its final name, synced, and renamed over
it (``os.replace``): a reader sees the old file or the new one, never part of one. Other
file systems (s3://, ...) keep Lightning's way.

``AsyncAtomicCheckpointIO`` writes in the background: Lightning's ``AsyncCheckpointIO``
copies every tensor of the checkpoint on the training thread (the snapshot of one step),
then one writer thread writes it through ``AtomicCheckpointIO`` while training goes on. At
most one save is in flight: the next one waits for it. Work that must follow a save (the
hard link of last.ckpt to the step file, the removal of the step file it supersedes) is
queued behind it with ``after_save``, so a kill at any moment leaves the newest complete
checkpoint in place; what must precede its write (a sharded head's files, and the wait for
the other ranks': callbacks/sharded_head_checkpoint.py) is queued with ``before_next_save``.
After a writer's error nothing more queued is done (the files on disk stay as they were).
A checkpoint whose copy would not fit in half of the free memory (D = 10^7 on a small
machine) is written synchronously instead, with a warning.

Lightning's writer thread, error and teardown are used as they are; ``save_checkpoint`` is
its own because Lightning's queues any number of saves (each with a copy of every tensor)
and its ``remove_checkpoint`` deletes at once, before the save that supersedes the file is
on disk. Why not ``torch.distributed.checkpoint.async_save``: docs/app.md, "Checkpoints and
resuming".
"""
from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning_utilities.core.apply_func import apply_to_collection
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO


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


def copy_atomically(source: str | Path, path: str | Path) -> None:
    """A copy of ``source`` at ``path``, written beside it and renamed into place."""
    source, path = Path(source), Path(path)
    tmp = path.with_name(f".{path.name}.copy{os.getpid()}")
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)


#: the file Lightning's spawn launcher passes a worker's trained weights in
SPAWN_WEIGHTS = ".temp.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    def __init__(self):
        super().__init__()
        self._after_next: list[Callable[[], object]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(str(path)):
            super().save_checkpoint(checkpoint, path, storage_options)
        else:
            atomic_torch_save(checkpoint, path)
        after, self._after_next = self._after_next, []
        for fn in after:
            fn()

    def after_next_save(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the next save (not yet called) is on disk."""
        self._after_next.append(fn)

    def remove_checkpoint(self, path) -> None:
        """The file removed; Lightning's spawn launcher hands a worker's weights to the launching
        process in ``<a mkdtemp folder>/.temp.ckpt`` and removes only the file: its folder, left
        empty, goes too (else every spawned ``fit`` leaves an empty folder in the temp dir)."""
        super().remove_checkpoint(path)
        folder, name = os.path.split(os.fspath(path))
        if name == SPAWN_WEIGHTS and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def snapshot_too_large(checkpoint: dict[str, Any], share: float = 0.5, to: torch.device | None = None) -> str | None:
    """Why a copy of the checkpoint's tensors would not fit in ``share`` of the free memory of
    their devices (host: MemAvailable; a GPU: its free memory), or None. ``to``: the device
    the copy is made on (None: each tensor's own)."""
    need: dict[torch.device, int] = {}

    def add(t: torch.Tensor) -> None:
        device = t.device if to is None else torch.device(to)
        need[device] = need.get(device, 0) + t.numel() * t.element_size()
    apply_to_collection(checkpoint, torch.Tensor, add)
    for device, size in need.items():
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_available_bytes()
        if free is not None and size > share * free:
            return (f"a snapshot of its tensors on {device} ({size / 2**30:.1f} GiB) would take more than "
                    f"{share:.0%} of the free memory ({free / 2**30:.1f} GiB)")
    return None


def host_available_bytes() -> int | None:
    """The host's MemAvailable (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class AsyncAtomicCheckpointIO(AsyncCheckpointIO):
    """Atomic saves written by a background thread, at most one in flight (module docstring).
    An error of the writer is raised by the next save, ``wait()`` or ``teardown()``."""

    def __init__(self):
        super().__init__(AtomicCheckpointIO())
        self._last: Future | None = None
        self._before_next: list[Callable[[], object]] = []
        self._after_next: list[Callable[[], object]] = []
        self._abandoned = False
        self.synchronous_saves = 0  # saves too large for a snapshot in free memory
        #: seconds from the start of the last save until it was on disk (None: none finished yet);
        #: the background write is part of a save's cost (on few cores it takes CPU from training)
        self.last_save_s: float | None = None
        self.total_save_s = 0.0  # the same summed over every save of this process that is on disk

    def __getstate__(self) -> dict:
        """ddp_spawn pickles the trainer for each call's workers: the writer thread, its queue and
        the marker of the last save stay in this process (a worker makes its own at its first save)."""
        return {**self.__dict__, "_executor": None, "_last": None}

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self.wait()  # the save before is on disk: at most one in flight
        self._abandoned = False
        start = time.monotonic()
        before, self._before_next = self._before_next, []
        short = snapshot_too_large(checkpoint)
        if short:  # no room for a copy: written now, from the tensors themselves
            if not self.synchronous_saves:
                warnings.warn(f"checkpoint saved synchronously: {short}", RuntimeWarning, stacklevel=2)
            self.synchronous_saves += 1
            self._ensure_setup()
            for fn in before:
                fn()
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
        else:  # the snapshot of this step, written in the writer thread (after what must precede it)
            snapshot = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
            for fn in before:
                self.after_save(fn)
            self.after_save(lambda: self.checkpoint_io.save_checkpoint(snapshot, path, storage_options))
        # done once the write just queued is (one writer thread: in order)
        self.after_save(lambda: self._on_disk(time.monotonic() - start))
        for fn in self._after_next:
            self.after_save(fn)
        self._after_next = []

    def _on_disk(self, seconds: float) -> None:
        self.last_save_s = seconds
        self.total_save_s += seconds

    def before_next_save(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in the writer thread just before the next save (not yet called) is written,
        after its snapshot; if ``fn`` raises, that save and what follows it are not done."""
        self._before_next.append(fn)

    def after_next_save(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in the writer thread once the next save (not yet called) is on disk."""
        self._after_next.append(fn)

    def remove_checkpoint(self, path) -> None:
        """Removed once the save in flight is on disk: until then the file it replaces stays."""
        self.after_save(lambda: self.checkpoint_io.remove_checkpoint(path))

    def after_save(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in the writer thread once the save queued before it is on disk (skipped
        after an error of the writer, and once the queue is abandoned)."""
        self._ensure_setup()

        def run() -> None:
            if self._error is not None or self._abandoned:
                return
            try:
                fn()
            except BaseException as error:  # noqa: BLE001  (raised on the training thread, as a save's)
                self._error = error
        self._last = self._executor.submit(run)

    def abandon(self) -> None:
        """The run failed: what is queued and not yet begun is dropped, quietly (the files on disk
        stay as they were), and a job that waits (for other ranks' files) may stop: ``abandoned``."""
        self._abandoned = True
        self._before_next, self._after_next = [], []

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def wait(self) -> None:
        """Return once every save queued is on disk (the SIGTERM save is synchronous by this)."""
        if self._last is not None:
            self._last.result()
            self._last = None
        if self._error:
            raise self._error
