"""Checkpoint files replaced atomically (checkpoint_io.py): a save that dies mid-write
leaves the previous file whole and no stray file; Lightning writes through it."""
import pytest
import torch

from lst_lightning.app.checkpoint_io import AtomicCheckpointIO, atomic_torch_save, link_atomically


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
