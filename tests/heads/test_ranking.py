"""Ranking over chunks of classes (heads/ranking.py) against the whole score matrix at once."""
import torch

from lst_lightning.heads.ranking import count_at_or_above, target_scores_of_chunks, topk_of_chunks


def chunks(S, width):
    return [(a, S[:, a:a + width]) for a in range(0, S.shape[1], width)]


def test_chunked_ranking_equals_the_whole_matrix():
    g = torch.Generator().manual_seed(0)
    S = torch.randint(0, 6, (9, 23), generator=g).double()  # many ties
    target = torch.randint(0, 23, (9,), generator=g)
    for width in (1, 4, 23):
        best, ids = topk_of_chunks(iter(chunks(S, width)), 5)
        assert torch.equal(best, S.topk(5, dim=1).values)
        assert torch.equal(S.gather(1, ids), best)  # ties may pick other ids of the same score
        t = target_scores_of_chunks(iter(chunks(S, width)), target)
        assert torch.equal(t, S.gather(1, target[:, None])[:, 0])
        count = count_at_or_above(iter(chunks(S, width)), target, t)
        # ties count against the target; its own column does not count
        assert torch.equal(count, (S >= t[:, None]).sum(1) - 1)


def test_padding_targets_score_zero_and_count_every_class_at_or_above():
    S = torch.tensor([[1.0, -2.0, 3.0]])
    target = torch.tensor([-1])
    t = target_scores_of_chunks(iter(chunks(S, 2)), target)
    assert float(t) == 0.0 and int(count_at_or_above(iter(chunks(S, 2)), target, t)) == 2
