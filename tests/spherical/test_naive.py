"""The reference itself (naive.py): its step is plain SGD with weight decay on an explicit W,
checked against torch.optim.SGD on a parameter trained with the loss's dense form."""
import pytest
import torch

from lst_lightning.losses import make_loss
from lst_lightning.spherical import NaiveSphericalHead

from head_pairs import batch


@pytest.mark.parametrize("loss", ["zloss", "taylor_softmax", "mse"])
def test_naive_step_is_torch_sgd_on_w(loss):
    D, d, m, K = 40, 6, 7, 3
    head = NaiveSphericalHead(num_classes=D, hidden_dim=d, loss=loss, lr=0.05, weight_decay=0.01,
                              dtype=torch.float64, bias=False)
    W = torch.nn.Parameter(head.weight())
    opt = torch.optim.SGD([W], lr=0.05, weight_decay=0.01)
    dense = make_loss(loss).dense
    for _ in range(5):
        H, idx = batch(m, d, D, K)
        Y = torch.zeros(m, D, dtype=torch.float64).scatter_add_(1, idx.clamp(min=0), (idx >= 0).double())
        Hh = H.clone().requires_grad_()
        head(Hh, idx).backward()
        Ht = H.clone().requires_grad_()
        opt.zero_grad()
        dense(Ht @ W.T, Y).mean().backward()
        opt.step()
        torch.testing.assert_close(Hh.grad, Ht.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(head.weight(), W.detach(), rtol=1e-12, atol=1e-14)
