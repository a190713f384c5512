"""V's row blocks (blocks.py): every row once, in order, as views that writes reach."""
import torch

from lst_lightning.spherical.blocks import BLOCK, CACHE_BYTES, in_place_blocks, row_blocks


def test_blocks_cover_every_row_once_and_write_through():
    X = torch.arange(23.0).reshape(23, 1)
    seen = []
    for a, blk in row_blocks(X, size=5):
        seen += [a + i for i in range(blk.shape[0])]
        blk.mul_(2)
    assert seen == list(range(23))
    assert torch.equal(X[:, 0], 2 * torch.arange(23.0))
    assert list(row_blocks(X[:0])) == []


def test_in_place_blocks_hold_cache_bytes_of_rows_on_the_cpu():
    X = torch.zeros(100_000, 128)  # 512 bytes a row
    sizes = [blk.shape[0] for _, blk in in_place_blocks(X)]
    assert sizes[0] == CACHE_BYTES // 512 < BLOCK and sum(sizes) == X.shape[0]
    assert [blk.shape[0] for _, blk in in_place_blocks(torch.zeros(3, 10**6))] == [1, 1, 1]  # a row over the bytes
