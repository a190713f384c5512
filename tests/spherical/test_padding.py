"""Padding in the spherical heads (base.py): a fully padded row contributes nothing to
the loss or the step, for every loss; ignore_index beside -1; the reductions "mean" (all
rows), "mean_real" (real rows) and "sum"; ranking inputs checked like the forward's."""
import pytest
import torch

from lst_lightning.losses import LOSSES
from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from head_pairs import HEAD_KW, LOSS_KW, batch, make_pair, rel, run_steps

HEADS = [FactoredSphericalHead, NaiveSphericalHead]


def head_at(cls, loss, W, **kw):
    head = cls(W.shape[0], W.shape[1], loss=loss, loss_kwargs=LOSS_KW.get(loss, {}), dtype=torch.float64,
               **{"bias": False, **HEAD_KW.get(loss, {}), **kw})
    head.reset_weight(W)
    return head


def step(head, H, idx):
    Hl = H.clone().requires_grad_()
    L = head(Hl, idx)
    L.backward()
    return L.detach(), Hl.grad, head.weight()


@pytest.mark.parametrize("cls", HEADS)
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("reduction,rows", [("sum", 1), ("mean", 8), ("mean_real", 4)])
def test_a_fully_padded_row_changes_nothing(cls, loss, reduction, rows):
    """8 rows, 3 of them padding only (-1 or -100): the loss, dL/dH and the step are those of
    the 4 real rows (and a row padded in one slot) summed, divided by the reduction's count."""
    W = torch.randn(30, 6, dtype=torch.float64) * 0.3
    H = torch.randn(8, 6, dtype=torch.float64)
    H[5:] *= 5
    idx = torch.tensor([[3, -1], [4, 4], [7, 1], [-1, -1], [2, 9], [-1, -1], [-100, -1], [-100, -100]])
    real = idx.ge(0).any(1)
    L0, g0, W0 = step(head_at(cls, loss, W, reduction="sum", lr=0.01 / rows), H[real], idx[real])
    L1, g1, W1 = step(head_at(cls, loss, W, reduction=reduction, lr=0.01), H, idx)
    torch.testing.assert_close(L1, L0 / rows)
    torch.testing.assert_close(g1[real], g0 / rows)
    assert torch.equal(g1[~real], torch.zeros(4, 6, dtype=torch.float64))
    torch.testing.assert_close(W1, W0)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "mean_real", "sum"])
def test_factored_equals_naive_with_padding_and_every_reduction(loss, reduction):
    f, n = make_pair(loss, reduction=reduction, lr=0.02)
    torch.manual_seed(1)
    for _ in range(4):
        H, idx = batch(6, 8, 60, 3, classes=12)  # padding slots, repeats within and across rows
        idx[4] = -1  # a fully padded row
        idx[5, 0] = -100  # PyTorch's ignore_index
        Hf, Hn = H.clone().requires_grad_(), H.clone().requires_grad_()
        Lf, Ln = f(Hf, idx), n(Hn, idx)
        Lf.backward()
        Ln.backward()
        assert rel(Lf, Ln) < 1e-10 and rel(Hf.grad, Hn.grad) < 1e-10 and rel(f.weight(), n.weight()) < 1e-10
        assert torch.equal(Hf.grad[4], torch.zeros(8, dtype=torch.float64))
    run_steps(f, n, steps=3, m=5, K=2, tol=1e-9)


@pytest.mark.parametrize("cls", HEADS)
def test_ignore_index_is_padding_and_configurable(cls):
    W = torch.randn(30, 6, dtype=torch.float64)
    H = torch.randn(4, 6, dtype=torch.float64)
    want = head_at(cls, "zloss", W)(H, torch.tensor([[1, -1], [2, 3], [-1, -1], [4, 4]]))
    got = head_at(cls, "zloss", W)(H, torch.tensor([[1, -100], [2, 3], [-100, -1], [4, 4]]))
    mine = head_at(cls, "zloss", W, ignore_index=-7)(H, torch.tensor([[1, -7], [2, 3], [-7, -1], [4, 4]]))
    assert torch.equal(got, want) and torch.equal(mine, want)
    with pytest.raises(ValueError, match="outside"):  # -100 is a bad id once ignore_index is another
        head = head_at(cls, "zloss", W, ignore_index=-7)
        head(H, torch.tensor([1, -100, 2, 3])).backward()  # the naive head raises here,
        head.sync()  # the factored head at its next read of the flags
    for bad in (3, 0, 1.5, True):
        with pytest.raises(ValueError, match="ignore_index"):
            cls(30, 6, ignore_index=bad)
    with pytest.raises(ValueError, match="reduction"):
        cls(30, 6, reduction="none")


@pytest.mark.parametrize("cls", HEADS)
def test_all_padding_is_a_zero_loss_and_no_change_under_mean_real(cls):
    W = torch.randn(30, 6, dtype=torch.float64)
    head = head_at(cls, "mse", W, reduction="mean_real")
    L, g, W1 = step(head, torch.randn(3, 6, dtype=torch.float64), torch.full((3, 2), -1))
    assert float(L) == 0.0 and torch.equal(g, torch.zeros_like(g)) and torch.equal(W1, W.to(W1))


@pytest.mark.parametrize("cls", HEADS)
def test_ranking_inputs_are_checked_like_the_forward(cls):
    head = cls(50, 6, bias=False)
    H = torch.randn(3, 6)
    for bad in (4000, 123456, 50, -1, -100):
        with pytest.raises(ValueError, match="not a class id"):
            head.target_rank(H, torch.tensor([1, bad, 2]))
    with pytest.raises(ValueError, match="shape"):
        head.target_rank(H, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="int64"):
        head.target_rank(H, torch.tensor([1.0, 2.0, 3.0]))
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="k must be"):
            head.topk(H, k)
    with pytest.raises(ValueError, match="hidden_dim"):
        head.topk(torch.randn(3, 5), 2)
    assert head.target_rank(H, torch.tensor([[1], [2], [3]])).shape == (3,)
    assert head.topk(H, 80)[1].shape == (3, 50)  # k beyond D: every class
