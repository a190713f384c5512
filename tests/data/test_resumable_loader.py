"""The training loader's position (resumable_loader.py): saved anywhere in an epoch and
loaded into a fresh loader, it goes on with exactly the batches the first would have given."""
import pytest
import torch
from torch.utils.data import DataLoader

from lst_lightning.data.ngram import EpochBatchSampler
from lst_lightning.data.resumable_loader import ResumableLoader


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, ids):
        return ids


def loader(**kw):
    return ResumableLoader(Ids(), sampler=EpochBatchSampler(50, 4, seed=7, drop_last=True), batch_size=None, **kw)


def epoch(dl, e):
    dl.sampler.set_epoch(e)  # what Lightning does at each epoch's start
    return [b.tolist() for b in dl]


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("stop", [1, 5, 12])
def test_a_loaded_position_goes_on_with_the_same_batches(stop, num_workers):
    first = loader()
    whole = epoch(first, 0), epoch(first, 1)
    first.sampler.set_epoch(1)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    assert state == {"epoch": 1, "batches": stop}
    second = loader(num_workers=num_workers)
    it = iter(second)  # Lightning makes the iterator before the position is loaded: it starts lazily
    second.load_state_dict(state)
    assert len(second) == 12  # the epoch's whole length: Lightning counts the done batches itself
    assert [b.tolist() for b in it] == whole[1][stop:]
    assert second.state_dict() == {"epoch": 1, "batches": 12}  # counted from where it resumed
    assert epoch(second, 2) == epoch(loader(), 2)  # the next epoch whole again


def test_a_position_at_the_epochs_end_starts_the_next_epoch():
    dl = loader()
    dl.load_state_dict({"epoch": 0, "batches": 12})
    assert list(dl) == []  # epoch 0 is done
    assert epoch(dl, 1) == epoch(loader(), 1)


def test_the_loader_leaves_torchs_generator_alone():
    """Its workers' seeds come from its own generator: a resumed run restores torch's."""
    before = torch.get_rng_state()
    list(loader())
    assert torch.equal(torch.get_rng_state(), before)
    list(DataLoader(Ids(), sampler=EpochBatchSampler(50, 4), batch_size=None))
    assert not torch.equal(torch.get_rng_state(), before)  # a plain DataLoader draws from it


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="needs an EpochBatchSampler"):
        ResumableLoader(Ids(), batch_size=None)
    with pytest.raises(ValueError, match="resume needs an epoch and a batch >= 0"):
        loader().load_state_dict({"epoch": 0, "batches": -1})
