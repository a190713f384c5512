"""Metrics against slow references."""
import math

import pytest
import torch

from lst_lightning.app.metrics import Perplexity, RankMetrics, read_simlex, simlex_spearman, unigram_ranks


def test_rank_metrics_match_definitions():
    ranks = torch.randint(1, 200, (1000,))
    m = RankMetrics((1, 5, 100))
    for part in ranks.split(97):
        m.update(part)
    out = m.compute()
    for k in (1, 5, 100):
        assert out[f"top{k}_error"].item() == pytest.approx(sum(r > k for r in ranks.tolist()) / 1000)
    assert out["mrr"].item() == pytest.approx(sum(1 / r for r in ranks.tolist()) / 1000, rel=1e-6)


def test_unigram_ranks_brute_force():
    counts = torch.tensor([9, 7, 7, 3, 3, 3, 1])
    targets = torch.tensor([0, 1, 2, 3, 6, 5, 1])
    expect = [int((counts >= counts[t]).sum()) for t in targets]
    assert unigram_ranks(counts, targets).tolist() == expect == [1, 3, 3, 6, 7, 6, 3]


def test_perplexity_and_non_finite():
    p = Perplexity()
    p.update(torch.log(torch.tensor([0.5, 0.25])))
    assert p.compute().item() == pytest.approx(math.sqrt(8))
    with pytest.raises(FloatingPointError):
        p.update(torch.tensor([float("nan")]))


def test_simlex_spearman():
    pairs = read_simlex()
    assert len(pairs) == 999
    words = sorted({w for a, b, _ in pairs[:50] for w in (a, b)})
    index = {w: i for i, w in enumerate(words)}
    # Embeddings built so that cosine similarity increases with the human score.
    emb = torch.randn(len(words), 16)
    rho, n = simlex_spearman(emb, index, pairs[:50])
    assert n == 50 and -1 <= rho <= 1
    e = torch.zeros(2 * 50, 2)
    idx, fake = {}, []
    for i, (a, b, s) in enumerate(pairs[:50]):
        ang = (10 - s) / 10 * math.pi / 2
        e[2 * i] = torch.tensor([1.0, 0.0])
        e[2 * i + 1] = torch.tensor([math.cos(ang), math.sin(ang)])
        idx[f"a{i}"], idx[f"b{i}"] = 2 * i, 2 * i + 1
        fake.append((f"a{i}", f"b{i}", s))
    rho, n = simlex_spearman(e, idx, fake)
    assert rho > 0.99
    assert math.isnan(simlex_spearman(e, idx, fake[:2])[0])
