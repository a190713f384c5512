"""Checkpoint files replaced atomically (checkpoint_io.py): a save that dies mid-write
leaves the previous file whole and no stray file; Lightning writes through it."""
import pytest
import torch

from lst_lightning.app.checkpoint_io import AtomicCheckpointIO, atomic_torch_save


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
