"""The two-level hierarchical softmax (hsoftmax.py) against its dense probabilities."""
import pytest
import torch
import torch.nn.functional as F

from lst_lightning.baselines import HierarchicalSoftmaxHead
from lst_lightning.baselines.hsoftmax import frequency_bins

from baseline_cases import D, d, dense_loss, grads, m, make_targets, zipf_counts


def hsoftmax_dense_log_probs(head, h):
    """log p(y|h) for all y by looping over clusters: the obviously-correct way."""
    cl = F.log_softmax(F.linear(h, head.cluster_weight, head.cluster_bias), 1)
    out = []
    for c in range(head.num_clusters):
        lo, hi = int(head.bounds[c]), int(head.bounds[c + 1])
        b = None if head.bias is None else head.bias[lo:hi]
        out.append(cl[:, c:c + 1] + F.log_softmax(F.linear(h, head.weight[lo:hi], b), 1))
    return torch.cat(out, 1)


@pytest.mark.parametrize("binning", ["equal_size", "equal_mass", "sqrt_mass"])
@pytest.mark.parametrize("bias", [True, False])
def test_hsoftmax_matches_dense(binning, bias):
    head = HierarchicalSoftmaxHead(num_classes=D, hidden_dim=d, class_counts=zipf_counts(), binning=binning,
                                   bias=bias)
    if bias:
        torch.nn.init.normal_(head.bias)
        torch.nn.init.normal_(head.cluster_bias)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(3)
    dense = hsoftmax_dense_log_probs(head, h)
    torch.testing.assert_close(dense.exp().sum(1), torch.ones(m))  # a distribution over classes
    params = [h, *head.parameters()]
    got, ref = head(h, t), dense_loss(dense, t)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=5)], 1)
        torch.testing.assert_close(full, dense)
        lp = head.log_prob(h, t)
        torch.testing.assert_close(lp, torch.where(t >= 0, dense.gather(1, t.clamp(min=0)), torch.zeros(())))


def test_frequency_bins():
    counts = zipf_counts(100)
    size = frequency_bins(100, 10, "equal_size")
    assert torch.equal(size, torch.arange(0, 101, 10))
    for binning in ("equal_mass", "sqrt_mass"):
        b = frequency_bins(100, 10, binning, counts)
        assert b[0] == 0 and b[-1] == 100 and (b[1:] > b[:-1]).all()
    mass = lambda b: torch.stack([counts[b[i]:b[i + 1]].sum() for i in range(len(b) - 1)])  # noqa: E731
    # Equal mass spreads the total count more evenly than equal size, sqrt-mass in between.
    spread = {k: mass(frequency_bins(100, 10, k, counts)).std() for k in ("equal_size", "sqrt_mass", "equal_mass")}
    assert spread["equal_mass"] < spread["sqrt_mass"] < spread["equal_size"]
    # Even a single dominant class leaves every cluster non-empty.
    b = frequency_bins(10, 5, "equal_mass", torch.tensor([1e9] + [1.0] * 9))
    assert (b[1:] > b[:-1]).all()
    with pytest.raises(ValueError, match="class_counts"):
        frequency_bins(100, 10, "equal_mass")
    with pytest.raises(ValueError, match="binning"):
        frequency_bins(100, 10, "by_length")
    with pytest.raises(ValueError, match="num_clusters"):
        frequency_bins(100, 101)
    with pytest.raises(ValueError, match="non-negative"):
        frequency_bins(3, 2, "equal_mass", torch.tensor([1.0, -1.0, 2.0]))
