"""logsumexp_rows against torch.logsumexp and its autograd gradient on fresh random inputs:
spreads far past float32's exp range, masked (-inf) entries, one column, float64 and float32."""
from __future__ import annotations

import pytest
import torch

from lst_kernels import logsumexp_rows, reference


def case(seed: int, m: int, n: int, spread: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Z = (torch.randn(m, n, generator=g, dtype=torch.float64) * spread).to(dtype)
    mask = torch.rand(m, n, generator=g) < 0.3
    mask[:, 0] = False  # every row keeps a finite entry
    return Z.masked_fill(mask, float("-inf"))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
@pytest.mark.parametrize("m, n, spread", [(7, 1, 1.0), (9, 65, 1.0), (16, 65, 120.0), (5, 300, 1e4)])
def test_equals_logsumexp_and_its_gradient(m, n, spread, dtype, tol):
    """Against the reference, torch.logsumexp, in float64 (in float32 torch's own gradient, exp(Z - lse), is
    off by |Z| ulp of lse: 1.5e-5 at spread 120)."""
    Z = case(m * n, m, n, spread, dtype)
    ours, exact = Z.clone().requires_grad_(), Z.double().requires_grad_()
    out, ref = logsumexp_rows(ours), reference.logsumexp_rows(exact)
    assert out.shape == (m, 1) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    w = torch.randn(m, 1, dtype=torch.float64)
    (g_ours,) = torch.autograd.grad((w.to(dtype) * out).sum(), ours)
    (g_ref,) = torch.autograd.grad((w * ref).sum(), exact)
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=tol, atol=tol)
    assert bool((g_ours[Z == float("-inf")] == 0).all())  # masked entries take no gradient


def test_one_finite_entry_is_that_entry():
    Z = torch.tensor([[3.5, float("-inf"), float("-inf")]], dtype=torch.float64)
    assert float(logsumexp_rows(Z)) == 3.5


@pytest.mark.parametrize("bad, message", [
    ([[1.0]], "must be a torch.Tensor"), (torch.ones(3), "floating \\(m, n\\)"),
    (torch.ones(2, 3, dtype=torch.int64), "floating \\(m, n\\)"), (torch.ones(2, 0), "n >= 1")])
def test_bad_input_is_one_line(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        logsumexp_rows(bad)


def test_impl_is_checked():
    with pytest.raises(ValueError, match="impl must be one of"):
        logsumexp_rows(torch.zeros(2, 3), impl="cuda")


def test_with_softmax_gives_the_softmax_outside_autograd():
    Z = case(5, 6, 9, 50.0, torch.float64).requires_grad_()
    lse, p = logsumexp_rows(Z, with_softmax=True)
    ref_lse, ref_p = reference.logsumexp_rows(Z.detach(), with_softmax=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(p, ref_p, rtol=1e-13, atol=1e-13)
    assert not lse.requires_grad and not p.requires_grad
