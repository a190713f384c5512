"""The adaptive softmax head (adaptive.py) against torch's AdaptiveLogSoftmaxWithLoss."""
import pytest
import torch

from lst_lightning.baselines import AdaptiveSoftmaxHead

from baseline_cases import D, dense_loss, grads, m, make_targets


def test_adaptive_matches_torch():
    head = AdaptiveSoftmaxHead(num_classes=D, hidden_dim=8, cutoffs=[4, 0.5], div_value=2.0)
    assert head.cutoffs == [4, 12]
    h = torch.randn(m, 8, requires_grad=True)
    t = make_targets(1)[:, 0].clamp(min=0)
    params = [h, *head.parameters()]
    got, ref = head(h, t), head.asm(h, t).loss
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=5)], 1)
        torch.testing.assert_close(full, head.asm.log_prob(h))
    # Several targets, padding and repeats: against torch's full log-probabilities.
    t3 = make_targets(3)
    got = head(h, t3)
    ref = dense_loss(head.asm.log_prob(h), t3)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cutoffs,match", [([], "non-empty"), ([5, 5], "increasing"), ([30], "increasing"),
                                           ([0.0], "fraction"), (["a"], "ints or floats"), ([0], "increasing")])
def test_adaptive_bad_cutoffs(cutoffs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdaptiveSoftmaxHead(num_classes=D, hidden_dim=8, cutoffs=cutoffs)


def test_adaptive_rejects_zero_width_tail():
    with pytest.raises(ValueError, match="width"):
        AdaptiveSoftmaxHead(num_classes=D, hidden_dim=6, cutoffs=[4, 8, 12], div_value=4.0)
