"""The synthetic Zipf task (synthetic.py): deterministic, Zipfian, learnable, and cheap at D = 10^7."""
import torch

from lst_lightning.data.synthetic import SyntheticZipf, zipf_counts


def test_synthetic_is_deterministic_zipfian_and_learnable():
    ds = SyntheticZipf(num_classes=10_000, context_size=3, size=50_000, p_rule=0.6, seed=5)
    ids = torch.arange(20_000)
    ctx, tgt = ds[ids]
    ctx2, tgt2 = ds[ids.flip(0)]
    assert torch.equal(ctx, ctx2.flip(0)) and torch.equal(tgt, tgt2.flip(0))
    assert tgt.min() >= 0 and tgt.max() < 10_000
    counts = torch.bincount(tgt, minlength=10_000)
    assert counts[:10].sum() > counts[100:110].sum() > counts[5000:5010].sum()
    follows = (tgt == (ctx[:, -1] ^ 1)).float().mean()
    assert 0.55 < follows < 0.7  # the rule plus chance coincidences
    other = SyntheticZipf(num_classes=10_000, context_size=3, size=50_000, seed=6)[ids][1]
    assert not torch.equal(tgt, other)



def test_synthetic_scales_to_ten_million_classes():
    ds = SyntheticZipf(num_classes=10**7, context_size=4, size=10**9, input_vocab_size=1000)
    ctx, tgt = ds[torch.arange(10**9 - 512, 10**9)]
    assert ctx.max() < 1000 and tgt.max() < 10**7
    c = zipf_counts(10**7)
    assert len(c) == 10**7 and (c[:-1] >= c[1:]).all() and c.min() >= 1


def test_a_batch_costs_nothing_in_D():
    """A batch is drawn from the example ids alone: at D = 10^15 no O(D) array could be
    allocated, yet the batch comes, in range, with both the head and the far tail drawn."""
    ids = torch.arange(4096)
    for D in (100, 10**15):
        ctx, tgt = SyntheticZipf(num_classes=D, context_size=3, size=10**6, input_vocab_size=D)[ids]
        assert ctx.shape == (4096, 3) and tgt.shape == (4096,)
        assert 0 <= ctx.min() and ctx.max() < D and 0 <= tgt.min() and tgt.max() < D
        assert (tgt == 0).any() and tgt.max() > D**0.5  # Zipf: the head and the far tail
