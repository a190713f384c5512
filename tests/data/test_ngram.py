"""n-gram windows and batch samplers (ngram.py) against plain loops."""
import pytest
import torch

from lst_lightning.data.ngram import EpochBatchSampler, NgramWindows


@pytest.mark.parametrize("bos", [None, 99])
def test_ngram_windows_match_a_loop(bos):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in [7, 2, 0, 4, 12, 3]]
    n = 3
    w = NgramWindows(docs, n, bos)
    expect = []
    for doc in docs:
        doc = ([bos] * n if bos is not None else []) + doc
        expect += [(doc[t - n : t], doc[t]) for t in range(n, len(doc))]
    assert len(w) == len(expect)
    ids = torch.randperm(len(w), generator=g)
    ctx, tgt = w[ids]
    for i, j in enumerate(ids.tolist()):
        assert ctx[i].tolist() == expect[j][0] and tgt[i].item() == expect[j][1]
    assert w.longest_document == 12 + (n if bos is not None else 0)



def test_epoch_sampler_is_a_function_of_seed_and_epoch():
    s = EpochBatchSampler(103, 10, seed=3, drop_last=True)
    s.set_epoch(2)
    a = [b.clone() for b in s]
    s.set_epoch(0)
    list(s)
    s.set_epoch(2)
    assert all(torch.equal(x, y) for x, y in zip(a, s))
    assert len(a) == len(s) == 10
    s.set_epoch(3)
    assert not torch.equal(torch.cat(a), torch.cat(list(s)))
    # ranks partition the examples
    parts = [torch.cat(list(EpochBatchSampler(103, 7, seed=3, rank=r, world_size=2))) for r in range(2)]
    ids = torch.cat(parts)
    assert sorted(ids[ids >= 0].tolist()) == list(range(103))



def test_eval_sampler_limit_is_spread_and_ordered():
    s = EpochBatchSampler(1000, 64, shuffle=False, limit=100)
    ids = torch.cat(list(s))
    assert len(ids) == 100 and ids[0] == 0 and ids[-1] == 999 and (ids.diff() > 0).all()
