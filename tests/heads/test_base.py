"""The interface's default evaluation (heads/base.py): target scores, ranks and
log-probabilities of every baseline head agree with its full scores."""
import pytest
import torch

from baseline_cases import HEADS, D, d, m


@pytest.mark.parametrize("name", sorted(HEADS))
def test_target_score_and_rank_agree_with_full_scores(name):
    head = HEADS[name]()
    h, t = torch.randn(m, d), torch.randint(0, D, (m,))
    with torch.no_grad():
        full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=5)], 1)
    target = head.target_score(h, t)
    torch.testing.assert_close(target, full.gather(1, t[:, None])[:, 0])
    # ties count against the target; its own column is left out: the chunks' rounding of its
    # score (here 5 classes a chunk against target_score's one chunk) must not move its rank
    at_or_above = full >= target[:, None]
    at_or_above[torch.arange(m), t] = False
    assert torch.equal(head.target_rank(h, t, chunk_size=5), 1 + at_or_above.sum(1))
    if head.has_log_prob:
        torch.testing.assert_close(head.log_prob(h, t), torch.log_softmax(full, 1).gather(1, t[:, None])[:, 0])
