"""The losses' gradients in closed form (``grads``, ``with_slots_grads``: the exact head's
step) against autograd of their forward, on fresh random inputs in float64: K > 1 targets,
padding, repeated classes, accidental hits, rows of weight 0, outputs past softplus's threshold."""
import pytest
import torch

from lst_lightning.losses import LOSSES, SampledSlots, make_loss
from lst_lightning.losses.base import SphericalLoss

from loss_cases import KWARGS, random_batch


def inputs(seed: int):
    torch.manual_seed(seed)
    O, idx, T = random_batch(m=6, D=40, K=3)
    A = torch.where(idx >= 0, O.gather(1, idx.clamp(min=0)), torch.zeros((), dtype=O.dtype))
    Y = torch.zeros_like(O).scatter_add_(1, idx.clamp(min=0), T)
    weight = torch.rand(6, dtype=torch.float64)
    weight[4] = 0.0  # a fully padded row's weight
    return (O * O).sum(1), O.sum(1), A, T, (Y * Y).sum(1), weight, idx, O.shape[1]


def autograd(fn, weight, *xs):
    xs = [x.detach().requires_grad_() for x in xs]
    per = fn(*xs)
    L = (torch.where(weight != 0, per, torch.zeros((), dtype=per.dtype)) * weight).sum()
    return (per.detach(), *torch.autograd.grad(L, xs, materialize_grads=True))


CASES = [(n, KWARGS.get(n, {})) for n in sorted(LOSSES) if not LOSSES[n].sampled] + [
    ("zloss", {}), ("zloss", {"a": 10.0, "b": 3.0})]  # a = 10: u = a (b - z) past softplus's threshold of 20


@pytest.mark.parametrize("name, kwargs", CASES)
def test_grads_equal_autograd(name, kwargs):
    loss = make_loss(name, **kwargs)
    q, s, A, T, y_sq, weight, _, D = inputs(len(name))
    got = loss.grads(q, s, A, T, weight, num_classes=D, y_sq=y_sq)
    want = autograd(lambda q, s, A: loss(q, s, A, T, num_classes=D, y_sq=y_sq), weight, q, s, A)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    if name == "zloss":  # its closed form, not the base class's autograd
        assert type(loss).grads is not SphericalLoss.grads
        mu = s[:, None] / D
        u = loss.a * (loss.b - (A - mu) / torch.sqrt(q[:, None] / D - mu * mu + loss.eps))
        assert bool(((u > 20.0) & (T > 0)).any()) == (kwargs.get("a") == 10.0)  # the threshold's branch taken


def test_zloss_grads_where_the_variance_is_clamped():
    loss = make_loss("zloss")
    q, s, A, T, _, weight, _, D = inputs(3)
    q = s * s / D - 1e-3  # q / D - mu^2 < 0: clamped to 0, no gradient through the variance
    got = loss.grads(q, s, A, T, weight, num_classes=D)
    want = autograd(lambda q, s, A: loss(q, s, A, T, num_classes=D), weight, q, s, A)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs", [{}, {"mu": 0.0}, {"mu": 2.0, "gram": 0.1},
                                    {"spherical": "mse"}, {"spherical": "spherical_softmax", "gram": 0.01}])
def test_composite_with_slots_grads_equal_autograd(kwargs):
    loss = make_loss("sampled", **kwargs)
    q, s, A, T, y_sq, weight, idx, D = inputs(7)
    S = 5
    A_neg = torch.randn(6, S, dtype=torch.float64) * 3
    hit = torch.zeros(6, S, dtype=torch.bool)
    hit[0, 1] = hit[2, 4] = True  # accidental hits
    first = (idx >= 0) & ~((idx[:, :, None] == idx[:, None, :]) & torch.ones(3, 3, dtype=torch.bool).tril(-1)).any(2)
    slots = SampledSlots(torch.randn(6, S, dtype=torch.float64), hit, first)
    got = loss.with_slots_grads(q, s, A, T, A_neg, slots, weight, num_classes=D, y_sq=y_sq)
    want = autograd(lambda q, s, A, An: loss.with_slots(q, s, A, T, An, slots, num_classes=D, y_sq=y_sq),
                    weight, q, s, A, A_neg)
    assert not bool(first[1, 2])  # the repeated class's second slot is not its first
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "mean_real", "sum"])
def test_row_weights_are_the_gradient_of_reduce(reduction):
    from lst_lightning.spherical import FactoredSphericalHead
    head = FactoredSphericalHead(num_classes=20, hidden_dim=4, loss="zloss", reduction=reduction, dtype=torch.float64)
    idx = torch.tensor([[1, -1], [-1, -1], [3, 3], [-1, 5]])
    per = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(head.reduce(per, idx), per)
    torch.testing.assert_close(head.row_weights(idx, torch.float64), want, rtol=0, atol=1e-15)
