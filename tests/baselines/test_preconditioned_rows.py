"""The sampled softmax with the right preconditioner on its drawn rows (preconditioned_rows.py,
``SampledSoftmaxHead(preconditioner=)``), held to an explicit reference: the loss and dL/dh are
plain autograd's, and the gradient of [W, b] is the dense gradient of the same draws times P, P
written out from its formula (heads/preconditioner.py) with an explicit inverse, in float64. K > 1
targets with padding and repeats, a row with no target, shared and per-row draws, dense and
row-sparse gradients. Alone, the head is one process (several: test_preconditioned_rows_ranks.py);
DDP leaves its moments alone, and a cast to half precision keeps them in their dtype."""
import copy

import pytest
import torch

from lst_lightning.app.module import LanguageModel
from lst_lightning.baselines import SampledSoftmaxHead
from lst_lightning.models import NgramMLP

from baseline_cases import D, d, m, make_targets
from preconditioner_formula import p_of

BETA, DAMPING = 0.9, 0.1


def heads(sampler="log_uniform", sparse=False, bias=True):
    """A head with P and its twin without, the same weights, in float64."""
    torch.manual_seed(0)
    kw = {"sampler_kwargs": {"num_features": 8, "leaf_size": 4}} if sampler == "rff" else {}
    with_p = SampledSoftmaxHead(num_classes=D, hidden_dim=d, num_samples=6, sampler=sampler, bias=bias,
                                sparse=sparse, preconditioner={"beta": BETA, "damping": DAMPING},
                                dtype=torch.float64, **kw)
    if bias:
        torch.nn.init.normal_(with_p.bias)
    plain = copy.deepcopy(with_p)
    plain.preconditioner = None
    return with_p, plain


def reference_moments(S0, w0, X, real):
    """The formula of heads/preconditioner.py, written out: the new moments and P."""
    Xr = X[real]
    S = BETA * S0 + (1 - BETA) * Xr.T @ Xr / Xr.shape[0]
    w = BETA * w0 + (1 - BETA)
    return S, w, p_of(S, w, DAMPING)


def dense(g):
    return g.to_dense() if g.is_sparse else g


def table_grads(head, loss, h):
    """dL/dh and the gradient of [W, b] (D x (d + 1); D x d without a bias), dense."""
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    dh, *gp = torch.autograd.grad(loss, [h, *params])
    gp = [dense(g) for g in gp]
    return dh, torch.cat([gp[0], gp[1][:, None]], 1) if len(gp) == 2 else gp[0]


@pytest.mark.parametrize("sampler", ["log_uniform", "rff"])  # draws shared by the rows; drawn per row
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_the_rows_gradient_is_the_dense_gradient_times_P(sampler, sparse, bias):
    with_p, plain = heads(sampler, sparse, bias)
    t = make_targets(3)  # K = 3: padding, repeats within and across rows, a row with no target
    real = (t >= 0).any(1)
    for step in range(3):  # the moments run on: P moves off the identity
        h = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
        X = torch.cat([h.detach(), torch.ones(m, 1, dtype=h.dtype)], 1) if bias else h.detach()
        S, w, P = reference_moments(with_p.input_moment.clone(), with_p.input_moment_weight.clone(), X, real)
        torch.manual_seed(10 + step)
        loss_p = with_p(h, t)
        torch.manual_seed(10 + step)
        loss = plain(h, t)
        assert torch.equal(loss_p, loss)
        dh_p, G_p = table_grads(with_p, loss_p, h)
        dh, G = table_grads(plain, loss, h)
        torch.testing.assert_close(dh_p, dh, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(G_p, G @ P, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(G @ P, G, rtol=1e-3, atol=0)  # P is not the identity here
        torch.testing.assert_close(with_p.input_moment, S, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(with_p.input_moment_weight, w)


def test_an_sgd_step_is_the_exact_heads_update_on_the_drawn_rows():
    """W <- W - lr G P: torch's SGD on the row-sparse gradient moves only the rows the step read."""
    with_p, plain = heads(sparse=True)
    t = make_targets(2)
    h = torch.randn(m, d, dtype=torch.float64)
    X = torch.cat([h, torch.ones(m, 1, dtype=h.dtype)], 1)
    _, _, P = reference_moments(with_p.input_moment, with_p.input_moment_weight, X, (t >= 0).any(1))
    torch.manual_seed(3)
    _, G = table_grads(plain, plain(h.requires_grad_(), t), h)
    before = torch.cat([with_p.weight.detach(), with_p.bias.detach()[:, None]], 1)
    opt = torch.optim.SGD(with_p.parameters(), lr=0.5)
    torch.manual_seed(3)
    with_p(h, t).backward()
    opt.step()
    after = torch.cat([with_p.weight.detach(), with_p.bias.detach()[:, None]], 1)
    torch.testing.assert_close(after, before - 0.5 * G @ P, rtol=1e-12, atol=1e-14)
    untouched = G.abs().sum(1) == 0
    assert untouched.any() and torch.equal(after[untouched], before[untouched])


def test_m_1_and_a_batch_with_no_target_leave_P_well_defined():
    """m = 1 counts one row; a batch whose every slot is padding leaves the moments as they were."""
    with_p, _ = heads()
    h = torch.randn(1, d, dtype=torch.float64, requires_grad=True)
    with_p(h, torch.tensor([[3, 3]])).backward()
    S, w = with_p.input_moment.clone(), with_p.input_moment_weight.clone()
    assert w > 0 and torch.isfinite(S).all()
    with_p(torch.randn(2, d, dtype=torch.float64, requires_grad=True), torch.full((2, 2), -1)).backward()
    assert torch.equal(with_p.input_moment, S) and torch.equal(with_p.input_moment_weight, w)


def test_bad_input_and_a_non_finite_loss_leave_the_moments():
    with_p, _ = heads()
    t = make_targets(1)
    with_p(torch.randn(m, d, dtype=torch.float64, requires_grad=True), t)
    S, w = with_p.input_moment.clone(), with_p.input_moment_weight.clone()
    bad = torch.randn(m, d, dtype=torch.float64)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        with_p(bad.requires_grad_(), t)
    with torch.no_grad():
        with_p.weight[t[1, 0]] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        with_p(torch.randn(m, d, dtype=torch.float64, requires_grad=True), t)
    assert torch.equal(with_p.input_moment, S) and torch.equal(with_p.input_moment_weight, w)


def test_evaluation_and_no_grad_forwards_leave_the_moments():
    with_p, _ = heads()
    t = make_targets(1)
    h = torch.randn(m, d, dtype=torch.float64)
    with torch.no_grad():
        with_p(h, t)
    with_p.eval()
    with_p(h, t)
    assert with_p.input_moment_weight == 0 and not with_p.input_moment.any()


def test_the_moments_are_in_the_checkpoint_and_a_resumed_head_steps_alike():
    with_p, _ = heads(sparse=True)
    t = make_targets(2)
    opt = torch.optim.SGD(with_p.parameters(), lr=0.5)
    for _ in range(2):
        with_p(torch.randn(m, d, dtype=torch.float64, requires_grad=True), t).backward()
        opt.step()
        opt.zero_grad()
    state = with_p.state_dict()
    assert {"input_moment", "input_moment_weight"} <= set(state) and state["input_moment_weight"] > 0
    resumed, _ = heads(sparse=True)
    resumed.load_state_dict(state)
    h = torch.randn(m, d, dtype=torch.float64)
    torch.manual_seed(5)
    _, g_a = table_grads(with_p, with_p(h.requires_grad_(), t), h)
    torch.manual_seed(5)
    _, g_b = table_grads(resumed, resumed(h, t), h)
    assert torch.equal(g_a, g_b)
    assert torch.equal(with_p.input_moment, resumed.input_moment)


def test_preconditioner_refuses_cosine_logits_and_unknown_settings():
    with pytest.raises(ValueError, match="cosine_scale"):
        SampledSoftmaxHead(num_classes=D, hidden_dim=d, cosine_scale=4.0, preconditioner={})
    with pytest.raises(ValueError, match="unknown preconditioner setting"):
        SampledSoftmaxHead(num_classes=D, hidden_dim=d, preconditioner={"betta": 0.9})


@pytest.mark.parametrize("preconditioner", [{}, None])
def test_ddp_leaves_the_moments_alone(preconditioner):
    """The ranks keep their moments alike themselves (every rank's rows): lst-train's module lists them in
    what DDP must not copy from rank 0; without P the head has no buffer DDP is told of."""
    head = SampledSoftmaxHead(num_classes=30, hidden_dim=4, preconditioner=preconditioner)
    lm = LanguageModel(NgramMLP(20, 2, 4, [4], 4), head, optimizer={"embedding": "dense"})
    lm.setup("fit")
    ignored = getattr(lm, "_ddp_params_and_buffers_to_ignore", [])
    assert ignored == (["head.input_moment", "head.input_moment_weight"] if preconditioner is not None else [])
    assert head.pg.world == 1  # distribute() ran: one process here


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cast_to_half_precision_keeps_the_moments_dtype(dtype):
    """As the exact head keeps its state: ``.to(torch.bfloat16)`` and ``.half()`` cast W and b, the moments
    keep their dtype (and step: the rows' gradient is in W's); ``.float()`` and ``.double()`` move them."""
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, num_samples=6, bias=True, preconditioner={}, dtype=dtype)
    head.to(torch.bfloat16)
    assert head.weight.dtype == torch.bfloat16
    assert head.input_moment.dtype == head.input_moment_weight.dtype == dtype
    head(torch.randn(m, d, dtype=torch.bfloat16, requires_grad=True), make_targets(2)).backward()
    assert head.weight.grad.dtype == torch.bfloat16 and head.input_moment_weight > 0
    assert torch.isfinite(head.input_moment).all()
    head.double()
    assert head.input_moment.dtype == torch.float64
    head.float().half()
    assert head.weight.dtype == torch.float16 and head.input_moment.dtype == torch.float32


@pytest.mark.parametrize("sampler", ["log_uniform", "rff"])  # draws shared by the rows; drawn per row
def test_under_cpu_autocast_the_rows_step_as_without_p_times_p(sampler):
    """``torch.autocast`` (bf16, as lst-train's ``bf16-mixed``): the logits are bf16 products of a
    float32 W, and their backward takes W in the logits' dtype, as autograd's does for the plain head
    (it raised on the mixed dtypes): dL/dh the plain head's, and the rows' gradient G P, to bf16."""
    with_p, plain = heads(sampler)
    with_p.float(), plain.float()
    t = make_targets(3)
    h = torch.randn(m, d, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(4)
        loss_p = with_p(h, t)
        torch.manual_seed(4)
        loss = plain(h, t)
    dh_p, G_p = table_grads(with_p, loss_p, h)
    dh, G = table_grads(plain, loss, h)
    assert G_p.dtype == torch.float32 and dh_p.dtype == torch.float32
    torch.testing.assert_close(dh_p, dh, rtol=2e-2, atol=2e-2 * dh.abs().max().item())  # bf16 products, summed apart
    P = p_of(with_p.input_moment.double(), with_p.input_moment_weight.double(), DAMPING)
    torch.testing.assert_close(G_p.double(), G.double() @ P, rtol=2e-2, atol=2e-2 * G.abs().max().item())
