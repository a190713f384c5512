"""V's row blocks (blocks.py): every row once, in order, as views that writes reach."""
import torch

from lst_lightning.spherical.blocks import row_blocks


def test_blocks_cover_every_row_once_and_write_through():
    X = torch.arange(23.0).reshape(23, 1)
    seen = []
    for a, blk in row_blocks(X, size=5):
        seen += [a + i for i in range(blk.shape[0])]
        blk.mul_(2)
    assert seen == list(range(23))
    assert torch.equal(X[:, 0], 2 * torch.arange(23.0))
    assert list(row_blocks(X[:0])) == []
