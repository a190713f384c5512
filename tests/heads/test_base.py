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


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_state_that_cannot_load_whole_is_refused_in_one_line_with_nothing_loaded(name):
    """``OutputHead.load_state_dict`` checks the state whole first: a tensor of another shape, and
    with ``strict`` a key missing or not the head's, are refused in one line, the head left as it was
    (torch's own loader copies the tensors that fit before it raises); strict=False loads the keys
    both have, and a state of the same kind loads."""
    head, other = HEADS[name](), HEADS[name]()
    with torch.no_grad():
        for t in other.state_dict(keep_vars=True).values():
            if t.is_floating_point():
                t.add_(1.0)
    saved = {k: v.clone() for k, v in head.state_dict().items()}
    good = other.state_dict()
    first, last = list(good)[0], list(good)[-1]
    shape = {**good, last: torch.zeros(*good[last].shape[:-1], good[last].shape[-1] + 1)}
    typo = {**{k: v for k, v in good.items() if k != last}, last + "_": good[last]}
    extra = {**good, "bias_": torch.zeros(1)}
    for bad, strict, why in ((shape, True, "has shape"), (shape, False, "has shape"), (typo, True, "missing"),
                             (extra, True, "not this head's")):
        with pytest.raises(RuntimeError, match=why) as err:
            head.load_state_dict(bad, strict=strict)
        assert "\n" not in str(err.value) and "nothing was loaded" in str(err.value)
        assert all(torch.equal(v, saved[k]) for k, v in head.state_dict().items()), "a refused state changed the head"
    head.load_state_dict(extra, strict=False)
    assert all(torch.equal(v, good[k]) for k, v in head.state_dict().items())
    head.load_state_dict(saved)
    assert torch.equal(head.state_dict()[first], saved[first])


def test_a_class_scoring_exactly_as_the_target_counts_against_it():
    """Ties count against the target even where a head's gathered target score rounds
    differently from its chunks of scores (linear heads gather with an einsum)."""
    from lst_lightning.heads import SoftmaxHead

    torch.manual_seed(0)
    head = SoftmaxHead(50, 16).eval()
    h, t = torch.randn(64, 16), torch.randint(0, 50, (64,))
    with torch.no_grad():
        head.weight.copy_(head.weight[:5].repeat(10, 1))  # every class tied with nine others
    full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=10)], 1)  # five chunks alike
    expected = (full >= full.gather(1, t[:, None])).sum(1)  # the target itself included
    assert torch.equal(head.target_rank(h, t, chunk_size=10), expected)
