"""head_checkpoint=per_rank (sharded_head_checkpoint.py) with the checkpoints written in the
background: each rank's file is written from a copy by its own writer, one in flight per rank,
and rank 0's checkpoint is renamed into place only once every rank's file of its step is on
disk. The ranks here are objects in one process, each with its own IO, driven in the order
Lightning calls them (every rank's on_save_checkpoint, then rank 0's save_checkpoint);
the two-process runs are in tests/app/test_ddp.py and test_resume.py."""
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lst_lightning.app.callbacks import ShardedHeadCheckpoint
from lst_lightning.app.callbacks import sharded_head_checkpoint as module
from lst_lightning.app.checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO, atomic_torch_save
from lst_lightning.heads.base import OutputHead
from lst_lightning.spherical.shard_files import load_rows

D, d = 6, 3


class Shard(OutputHead):
    sharded = True

    def __init__(self, lo, hi, V):
        super().__init__()
        self.row_lo, self.row_hi, self.V = lo, hi, V


class Rank:
    """One process: its trainer (as far as the callback reads it), head, callback and IO."""

    def __init__(self, root: Path, rank: int, world: int, V: torch.Tensor, io, **kw):
        lo, hi = rank * D // world, (rank + 1) * D // world
        self.head = Shard(lo, hi, V[lo:hi].clone())
        self.module = nn.ModuleDict({"head": self.head})
        self.cb, self.io = ShardedHeadCheckpoint("per_rank", **kw), io
        self.trainer = types.SimpleNamespace(
            global_step=0, global_rank=rank, world_size=world, default_root_dir=str(root),
            checkpoint_callback=types.SimpleNamespace(dirpath=str(root / "checkpoints")),
            strategy=types.SimpleNamespace(checkpoint_io=io, barrier=lambda name=None: None))

    def dump(self, step: int) -> dict:
        """Lightning's dump_checkpoint on this rank: the callback's hook."""
        self.trainer.global_step = step
        checkpoint = {"global_step": step, "state_dict": {"head.V": self.head.V, "head._extra_state": {}}}
        self.cb.on_save_checkpoint(self.trainer, self.module, checkpoint)
        return checkpoint


def ranks(tmp_path, world=2, io=AsyncAtomicCheckpointIO, **kw):
    V = torch.randn(D, d)
    kw.setdefault("wait_s", 60)  # a test gone wrong fails, not hangs for the default half hour
    return V, [Rank(tmp_path, r, world, V, io(), **kw) for r in range(world)]


def save(all_ranks, step, skip=()):
    """A save at ``step``: every rank's hook (but those in ``skip``), then rank 0's checkpoint."""
    dumped = [r.dump(step) for i, r in enumerate(all_ranks) if i not in skip]
    all_ranks[0].io.save_checkpoint(dumped[0], last_of(all_ranks))


def last_of(all_ranks):
    return Path(all_ranks[0].trainer.checkpoint_callback.dirpath) / "last.ckpt"


def saved_step(all_ranks):
    return torch.load(last_of(all_ranks), weights_only=True)["global_step"]


def shards(tmp_path, step):
    return tmp_path / "checkpoints" / "head_shards" / f"step{step}"


@pytest.fixture
def gate(monkeypatch):
    """Rank 1's file writes wait at the gate (set: open); ``writing`` is set when one arrives."""
    gate, writing = threading.Event(), threading.Event()
    gate.set()

    def held(obj, path):
        if Path(path).name == "rank00001.pt":
            writing.set()
            assert gate.wait(timeout=60)
        atomic_torch_save(obj, path)
    monkeypatch.setattr(module, "atomic_torch_save", held)
    return types.SimpleNamespace(gate=gate, writing=writing)


class Polls:
    """``arm()``: an event set once rank 0's writer has then looked for missing files 3 times."""

    def __init__(self):
        self.count, self.seen = 0, threading.Event()

    def arm(self) -> threading.Event:
        self.count, self.seen = 0, threading.Event()
        return self.seen

    def sleep(self, s):
        self.count += 1
        if self.count >= 3:
            self.seen.set()
        time.sleep(min(s, 0.01))


@pytest.fixture
def polls(monkeypatch):
    polls = Polls()
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=polls.sleep))
    return polls


def test_the_checkpoint_waits_for_every_ranks_file_of_its_step(tmp_path, gate, polls):
    """Rank 1's file of step 2 is held: rank 0's checkpoint of step 2 stays unwritten (last.ckpt
    at step 1, whose directory is not pruned, keep=1) until it is on disk; the file holds
    the rows as they were at the save, though training changed them meanwhile."""
    V, (r0, r1) = ranks(tmp_path, keep=1)
    save([r0, r1], 1)
    r0.io.wait()
    assert saved_step([r0, r1]) == 1
    gate.gate.clear()
    waiting = polls.arm()
    save([r0, r1], 2)
    assert gate.writing.wait(timeout=60) and waiting.wait(timeout=60)  # rank 0's writer waits for rank 1's file
    r1.head.V += 1  # training goes on
    assert saved_step([r0, r1]) == 1 and (shards(tmp_path, 2) / "rank00000.pt").exists()
    assert sorted(p.name for p in shards(tmp_path, 2).parent.iterdir()) == ["step1", "step2"]
    files = torch.load(last_of([r0, r1]), weights_only=True)["state_dict"]["head._extra_state"]["v_files"]
    assert torch.equal(load_rows(files), V)  # the checkpoint on disk has all of its files
    gate.gate.set()
    r1.io.wait()
    r0.io.wait()
    saved = torch.load(last_of([r0, r1]), weights_only=True)
    assert saved["global_step"] == 2 and saved["state_dict"]["head.V"].numel() == 0
    assert saved["state_dict"]["head._extra_state"]["v_files"] == str(shards(tmp_path, 2).resolve())
    assert torch.equal(load_rows(shards(tmp_path, 2)), V)
    assert [p.name for p in shards(tmp_path, 2).parent.iterdir()] == ["step2"]  # pruned once step 2 is on disk
    assert sorted(p.name for p in shards(tmp_path, 2).iterdir()) == ["rank00000.pt", "rank00001.pt"]  # no temp file
    for r in (r0, r1):
        r.io.teardown()


def test_one_file_in_flight_per_rank(tmp_path, gate):
    """A rank's next save waits until its file before is on disk (rank 0's: until its checkpoint
    is, which waits for rank 1's file), then copies its rows of the new step."""
    V, (r0, r1) = ranks(tmp_path)
    gate.gate.clear()
    save([r0, r1], 1)
    assert gate.writing.wait(timeout=60)
    r1.head.V += 1
    nexts = [threading.Thread(target=r.dump, args=(2,)) for r in (r0, r1)]
    for t in nexts:
        t.start()
    for t in nexts:
        t.join(timeout=0.5)
    assert all(t.is_alive() for t in nexts)  # both wait for the file of step 1
    assert not shards(tmp_path, 2).exists() and not last_of([r0, r1]).exists()
    gate.gate.set()
    for t in nexts:
        t.join(timeout=60)
    r0.io.save_checkpoint({"global_step": 2}, last_of([r0, r1]))
    for r in (r1, r0):
        r.io.wait()
    assert torch.equal(load_rows(shards(tmp_path, 1)), V)
    assert torch.equal(load_rows(shards(tmp_path, 2)), torch.cat([V[:D // 2], V[D // 2:] + 1]))
    for r in (r0, r1):
        r.io.teardown()


def test_a_missing_rank_file_is_a_one_line_error_and_no_checkpoint(tmp_path):
    """Rank 1's file never arrives (a directory not shared by the ranks): after wait_s, the
    save is not written, nor anything queued after it, and the next wait raises one line
    naming the file and the need for a shared file system."""
    _, (r0, r1) = ranks(tmp_path, wait_s=0.05)
    save([r0, r1], 1, skip={1})
    with pytest.raises(TimeoutError) as error:
        r0.io.wait()
    message = str(error.value)
    assert "\n" not in message and "rank00001.pt of 2 ranks not in" in message
    assert "checkpoint of step 1 is not written" in message and "file system shared by the ranks" in message
    assert not last_of([r0, r1]).exists()
    with pytest.raises(TimeoutError):
        r0.io.teardown()


def test_a_failed_run_stops_waiting_and_drops_its_save(tmp_path, polls):
    """An exception (not SIGTERM) while rank 0's writer waits for a rank that will never write:
    the save is dropped quietly, the checkpoint before stays, teardown returns at once."""
    _, (r0, r1) = ranks(tmp_path)
    save([r0, r1], 1)
    r0.io.wait()
    waiting = polls.arm()
    save([r0, r1], 2, skip={1})
    assert waiting.wait(timeout=60)
    r0.cb.on_exception(r0.trainer, r0.module, SIGTERMException())
    assert not r0.io.abandoned  # SIGTERM's save waits for the ranks
    r0.cb.on_exception(r0.trainer, r0.module, RuntimeError("a rank failed"))
    r0.io.teardown()  # no error: the run's own is the one reported
    assert saved_step([r0, r1]) == 1 and shards(tmp_path, 1).exists()
    r1.io.teardown()


def test_rows_too_large_to_copy_are_written_at_once(tmp_path, monkeypatch):
    """No room for a copy of the rows in half of MemAvailable: the file is on disk when the hook
    returns (one warning for the run)."""
    monkeypatch.setattr("lst_lightning.app.checkpoint_io.host_available_bytes", lambda: 10)
    V, (_, r1) = ranks(tmp_path)
    with pytest.warns(RuntimeWarning, match="head shard saved synchronously: a snapshot of its tensors on cpu"):
        r1.dump(1)
    assert torch.equal(torch.load(shards(tmp_path, 1) / "rank00001.pt", weights_only=True)["V"], V[D // 2:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r1.dump(2)
    assert (shards(tmp_path, 2) / "rank00001.pt").exists() and r1.cb.synchronous_saves == 2
    r1.io.teardown()


def test_a_synchronous_io_writes_the_files_first_and_prunes_after_the_checkpoint(tmp_path):
    V, (r0, r1) = ranks(tmp_path, io=AtomicCheckpointIO, keep=1)
    save([r0, r1], 1)
    [r.dump(2) for r in (r0, r1)]
    assert torch.equal(load_rows(shards(tmp_path, 2)), V)  # on disk before the checkpoint is written
    assert shards(tmp_path, 1).exists()  # named by last.ckpt until the checkpoint of step 2 replaces it
    r0.io.save_checkpoint({"global_step": 2}, last_of([r0, r1]))
    assert saved_step([r0, r1]) == 2 and not shards(tmp_path, 1).exists()
