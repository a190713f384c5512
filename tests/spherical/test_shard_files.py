"""Per-rank files of a sharded V: any row range reads back, gaps are an error, old saves go."""
import pytest
import torch

from lst_lightning.spherical.shard_files import load_rows, prune, save_shard


def test_rows_read_back_across_shard_boundaries(tmp_path):
    V = torch.randn(10, 3)
    for r, (lo, hi) in enumerate([(0, 4), (4, 8), (8, 10)]):
        save_shard(tmp_path, r, (lo, hi), V[lo:hi])
    assert torch.equal(load_rows(tmp_path), V)
    assert torch.equal(load_rows(tmp_path, 3, 9), V[3:9])  # another number of ranks
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_rows_and_missing_files_are_errors(tmp_path):
    save_shard(tmp_path, 0, (0, 4), torch.randn(4, 3))
    with pytest.raises(ValueError, match="cover 4 of the rows 0:6"):
        load_rows(tmp_path, 0, 6)
    with pytest.raises(FileNotFoundError, match="no shard files"):
        load_rows(tmp_path / "nowhere", 0, 1)


def test_prune_keeps_the_newest_saves(tmp_path):
    for step in (5, 40, 100, 7):
        save_shard(tmp_path / f"step{step}", 0, (0, 1), torch.zeros(1, 2))
    prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step100", "step40"]
