"""Checkpoint files replaced atomically (checkpoint_io.py): a save that dies mid-write
leaves the previous file whole and no stray file; Lightning writes through it; the
asynchronous IO writes a snapshot in the background, one save at a time."""
import pickle
import threading
import types

import pytest
import torch

from lst_lightning.app.checkpoint_io import (SPAWN_WEIGHTS, AsyncAtomicCheckpointIO, AtomicCheckpointIO, atomic_torch_save,
                                             link_atomically)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("killed mid-write")


def test_a_failed_save_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.arange(1000.0)}, path)
    with pytest.raises(RuntimeError, match="killed mid-write"):  # after the tensor's bytes are written
        atomic_torch_save({"step": 2, "w": torch.zeros(1000), "x": Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    AtomicCheckpointIO().save_checkpoint({"step": 3}, path)
    assert AtomicCheckpointIO().load_checkpoint(path, weights_only=True) == {"step": 3}


@pytest.mark.parametrize("io", [AtomicCheckpointIO, AsyncAtomicCheckpointIO])
def test_the_spawn_launchers_weights_file_leaves_no_folder_and_other_removals_keep_theirs(tmp_path, io):
    """Lightning's spawn launcher saves a worker's weights in a fresh temp folder and removes
    the file through the checkpoint IO: the folder goes with it; any other file's folder stays."""
    spawned, crowded, kept = (tmp_path / "tmpabc" / SPAWN_WEIGHTS, tmp_path / "tmpdef" / SPAWN_WEIGHTS,
                              tmp_path / "checkpoints" / "last.ckpt")
    for path in (spawned, crowded, crowded.with_name("x"), kept, kept.with_name("other.ckpt")):
        atomic_torch_save({"step": 1}, path)
    plugin = io()
    for path in (spawned, crowded, kept):
        plugin.remove_checkpoint(path)
    if io is AsyncAtomicCheckpointIO:
        plugin.teardown()  # the removals run in its writer thread
    assert not spawned.parent.exists()
    assert [p.name for p in crowded.parent.iterdir()] == ["x"]  # a folder with something else in it stays
    assert [p.name for p in kept.parent.iterdir()] == ["other.ckpt"]


def test_last_becomes_a_link_to_the_step_file_or_stays_as_it_was(tmp_path, monkeypatch):
    step, last = tmp_path / "step5.ckpt", tmp_path / "last.ckpt"
    atomic_torch_save({"step": 4}, last)
    atomic_torch_save({"step": 5}, step)
    assert link_atomically(step, last)
    assert last.stat().st_ino == step.stat().st_ino and torch.load(last, weights_only=True) == {"step": 5}
    step.unlink()  # the step file pruned: last.ckpt stays whole
    assert torch.load(last, weights_only=True) == {"step": 5}
    atomic_torch_save({"step": 6}, step)  # a newer save under the same name

    def no_hard_links(*_):
        raise OSError("hard links not supported")
    monkeypatch.setattr("os.link", no_hard_links)
    assert not link_atomically(step, last)  # the caller then writes a copy
    assert torch.load(last, weights_only=True) == {"step": 5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step5.ckpt"]  # no stray link


def test_an_async_save_writes_the_snapshot_of_its_step_one_at_a_time(tmp_path, monkeypatch):
    """The tensors are copied when the save is called (training may change them at once),
    the write runs in the writer thread, a second save waits for the first, work queued with
    after_save follows the save, and the writer's error is raised on the training thread."""
    io, w = AsyncAtomicCheckpointIO(), torch.zeros(4)
    gate, writing = threading.Event(), threading.Event()
    write = atomic_torch_save

    def held(obj, path):  # the first write waits at the gate
        writing.set()
        gate.wait(timeout=60)
        write(obj, path)
    monkeypatch.setattr("lst_lightning.app.checkpoint_io.atomic_torch_save", held)
    io.save_checkpoint({"w": w}, tmp_path / "a.ckpt")
    assert writing.wait(timeout=60) and threading.current_thread() is threading.main_thread()
    w += 1  # training goes on while the write is held
    assert not (tmp_path / "a.ckpt").exists()
    second = threading.Thread(target=io.save_checkpoint, args=({"w": w}, tmp_path / "b.ckpt"))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # waits for the first save: one in flight at most
    gate.set()
    second.join(timeout=60)
    io.after_save(lambda: link_atomically(tmp_path / "b.ckpt", tmp_path / "last.ckpt"))
    io.wait()
    assert torch.equal(torch.load(tmp_path / "a.ckpt", weights_only=True)["w"], torch.zeros(4))
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=True)["w"], torch.ones(4))
    io.save_checkpoint({"x": Unpicklable()}, tmp_path / "c.ckpt")
    with pytest.raises(RuntimeError, match="killed mid-write"):
        io.wait()
    assert not (tmp_path / "c.ckpt").exists()
    with pytest.raises(RuntimeError, match="killed mid-write"):
        io.teardown()


def test_an_async_save_reports_how_long_it_took_until_on_disk(tmp_path, monkeypatch):
    """last_save_s: from the save's start until the background write is done (the budget of
    PeriodicCheckpoint counts it); total_save_s sums the saves. On a fake clock where each
    write takes 3 s, then 2 s."""
    io, write, clock = AsyncAtomicCheckpointIO(), atomic_torch_save, {"t": 100.0}
    monkeypatch.setattr("lst_lightning.app.checkpoint_io.time", types.SimpleNamespace(monotonic=lambda: clock["t"]))
    took = iter([3.0, 2.0])

    def slow(obj, path):
        clock["t"] += next(took)
        write(obj, path)
    monkeypatch.setattr("lst_lightning.app.checkpoint_io.atomic_torch_save", slow)
    assert io.last_save_s is None
    io.save_checkpoint({"w": torch.zeros(4)}, tmp_path / "a.ckpt")
    io.wait()
    assert io.last_save_s == io.total_save_s == 3.0 and (tmp_path / "a.ckpt").is_file()
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    io.wait()
    assert (io.last_save_s, io.total_save_s) == (2.0, 5.0)
    again = pickle.loads(pickle.dumps(io))  # ddp_spawn pickles the trainer for its workers
    assert again.last_save_s == io.last_save_s and again._executor is None
    io.teardown()


def test_a_checkpoint_too_large_to_copy_is_written_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr("lst_lightning.app.checkpoint_io.host_available_bytes", lambda: 100 * 4)
    io, w = AsyncAtomicCheckpointIO(), torch.zeros(60)  # 240 bytes > half of 400
    with pytest.warns(RuntimeWarning, match=r"saved synchronously: a snapshot of its tensors on cpu"):
        io.save_checkpoint({"w": w}, tmp_path / "a.ckpt")
    assert (tmp_path / "a.ckpt").exists() and io.synchronous_saves == 1  # on disk when the call returns
    io.save_checkpoint({"w": w[:40]}, tmp_path / "b.ckpt")  # 160 bytes: copied, written in the background
    io.teardown()
    assert io.synchronous_saves == 1 and torch.equal(torch.load(tmp_path / "b.ckpt", weights_only=True)["w"], w[:40])


def test_work_before_a_save_runs_in_the_writer_and_its_error_stops_what_follows(tmp_path):
    """before_next_save: after the save's snapshot, before its write, in the writer thread; when
    it raises, neither the write nor what was queued after it is done, and the error is raised on
    the training thread; abandon() drops what is queued, quietly."""
    io, order = AsyncAtomicCheckpointIO(), []
    atomic_torch_save({"step": 1}, tmp_path / "last.ckpt")
    io.before_next_save(lambda: order.append(("before", (tmp_path / "a.ckpt").exists(),
                                              threading.current_thread() is threading.main_thread())))
    io.after_next_save(lambda: order.append(("after", (tmp_path / "a.ckpt").exists())))
    io.save_checkpoint({"step": 2}, tmp_path / "a.ckpt")
    io.wait()
    assert order == [("before", False, False), ("after", True)]

    def fails():
        raise OSError("a rank's file is missing")
    io.before_next_save(fails)
    io.save_checkpoint({"step": 3}, tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # superseded by a save that was not written: stays
    with pytest.raises(OSError, match="a rank's file is missing"):
        io.wait()
    assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {"step": 1} and (tmp_path / "a.ckpt").exists()

    io, gate = AsyncAtomicCheckpointIO(), threading.Event()
    io.before_next_save(lambda: gate.wait(timeout=60))
    io.save_checkpoint({"step": 4}, tmp_path / "last.ckpt")
    io.abandon()
    assert io.abandoned
    gate.set()
    io.teardown()  # no error
    assert torch.load(tmp_path / "last.ckpt", weights_only=True) == {"step": 1}


def test_a_synchronous_save_runs_the_work_after_it_once_on_disk(tmp_path):
    io, seen = AtomicCheckpointIO(), []
    io.after_next_save(lambda: seen.append(torch.load(tmp_path / "a.ckpt", weights_only=True)))
    io.save_checkpoint({"step": 1}, tmp_path / "a.ckpt")
    io.save_checkpoint({"step": 2}, tmp_path / "a.ckpt")
    assert seen == [{"step": 1}]
