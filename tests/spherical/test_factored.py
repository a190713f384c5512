"""The factored head against the naive explicit-W head, step after step, and its safety."""
import copy

import pytest
import torch

from lst_lightning.losses import LOSSES
from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead, plan
from lst_lightning.spherical.driving import SYNC_EVERY

from head_pairs import (
    LOSS_KW,
    D,
    assert_untouched,
    batch,
    d,
    deferred,
    make_pair,
    run_steps,
    state,
    state_of,
    step_both,
)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,K", [(1, 1), (7, 3)])
@pytest.mark.parametrize("sync_every", [1, SYNC_EVERY])  # checks read at once; device flags (the default)
def test_exact_float64(loss, bias, m, K, sync_every):
    f, n = make_pair(loss, bias=bias, lr=0.05, weight_decay=0.01, sync_every=sync_every)
    # The squared error at m = 1 takes nearly singular steps here (2 lr ||h||^2 near 1): both
    # ways of checking fold them into V within their own step.
    run_steps(f, n, steps=40, m=m, K=K, tol=1e-9)
    assert int(f.steps) == 40


def test_the_q_route_is_the_one_with_fewer_multiply_adds():
    """Through M (3 m^2 d + m d^2) up to m = d, from d x d products (2 m d^2 + 2 d^3, H^T diag(g_q) H
    formed for B) above."""
    for w in (8, 9, 129, 513):
        cheaper = [m for m in range(1, 4 * w) if 3 * m * m * w + m * w * w <= 2 * m * w * w + 2 * w ** 3]
        assert cheaper == list(range(1, plan.m_matrix_rows(w) + 1)), w


@pytest.mark.parametrize("route", ["m_matrix", "factors"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_both_routes_of_q_are_exact(loss, route, monkeypatch):
    """Each route of Q's update forced at one size (m = 13 > d: the rule takes the factors
    there), K = 3 with padding and repeated classes: the same W as the naive head."""
    monkeypatch.setattr(plan, "m_matrix_rows", lambda d: 10**9 if route == "m_matrix" else -1)
    f, n = make_pair(loss, bias=True, lr=0.05, weight_decay=0.01)
    run_steps(f, n, steps=20, m=13, K=3, tol=1e-9)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_exact_float32_against_float64_reference(loss):
    torch.manual_seed(0)
    f, n = make_pair(loss, D=300, d=16, bias=True, dtype=torch.float32, ref_dtype=torch.float64,
                     lr=0.02, weight_decay=0.001)
    # The spherical softmax's gradient divides by (a^2 + eps) and (q + D eps): it amplifies
    # float32 rounding (measured 2e-4 to 7e-3 over six seeds; the others stay below 3e-5).
    tol = 1e-2 if loss == "spherical_softmax" else 2e-4
    run_steps(f, n, steps=300, m=8, K=2, classes=40, tol=tol)


def test_exact_with_target_values_and_sum_reduction():
    f, n = make_pair("zloss", lr=0.01, reduction="sum")
    run_steps(f, n, steps=20, m=5, K=3, vals=True)


def test_upstream_gradient_scales_the_step():
    f, n = make_pair("taylor_softmax", lr=0.05)
    H, idx = batch(4, 8, 60, 2)
    errs = step_both(f, n, H, idx, scale=2.5)
    assert max(errs) < 1e-9


def test_lr_schedule_is_followed():
    f, n = make_pair("spherical_softmax", lr=0.05)
    for lr in (0.05, 0.02, 0.1, 0.001):
        f.lr = n.lr = lr
        H, idx = batch(5, 8, 60, 1)
        assert max(step_both(f, n, H, idx)) < 1e-9














def test_log_prob_scores_and_rank_match_naive():
    f, n = make_pair("spherical_softmax", lr=0.05)
    run_steps(f, n, steps=5, m=4, K=1)
    H, idx = batch(6, 8, 60, 1)
    idx = idx[:, 0]
    torch.testing.assert_close(f.log_prob(H, idx), n.log_prob(H, idx))
    torch.testing.assert_close(f.scores(H, 10, 30), n.scores(H, 10, 30))
    assert torch.equal(f.target_rank(H, idx, chunk_size=7), n.target_rank(H, idx, chunk_size=13))
    full = torch.cat([n.scores(H)], 1)
    want = (full >= full.gather(1, idx[:, None])).sum(1)  # the target counts itself once
    assert torch.equal(f.target_rank(H, idx), want)




@pytest.mark.parametrize("loss", ["spherical_softmax", "taylor_softmax", "zloss", "mse"])
def test_ranking_is_by_the_loss_own_score(loss):
    f, n = make_pair(loss, scale=1.5)  # outputs far below -1 and above 1
    H, idx = batch(40, 8, 60, 1)
    idx = idx[:, 0]
    O = H @ n.weight().T
    want_top = n.loss_fn.score(O).topk(5, dim=1).indices
    for head in (f, n):
        assert torch.equal(head.topk(H, 5, chunk_size=7)[1], want_top)
    if n.has_log_prob:  # the argmax of the head's own probabilities is its top-1
        p = n.loss_fn.dense_log_prob(O)
        assert torch.equal(f.topk(H, 1)[1][:, 0], p.argmax(1))
        assert (O.argmax(1) != p.argmax(1)).any()  # ranking by o would not be
        assert torch.equal(f.target_rank(H, idx), (p >= p.gather(1, idx[:, None])).sum(1))
    assert torch.equal(f.target_rank(H, idx, chunk_size=7), n.target_rank(H, idx, chunk_size=13))


def test_state_dict_round_trip_is_bit_identical():
    f, _ = make_pair("zloss", lr=0.05, stabiliser={"check_every": 3})
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 8, generator=g, dtype=torch.float64), torch.randint(0, 60, (5, 2), generator=g))
            for _ in range(12)]
    for H, idx in data[:6]:
        f(H.clone().requires_grad_(), idx).backward()
    f.lr = 0.03
    other = FactoredSphericalHead(num_classes=60, hidden_dim=8, loss="zloss", dtype=torch.float64, bias=False)
    before = state_of(other)
    with pytest.raises(ValueError, match="saved with loss"):  # zloss a=0.5, b=2 is not the default
        other.load_state_dict(f.state_dict())
    assert_untouched(other, before)
    g2 = FactoredSphericalHead(num_classes=60, hidden_dim=8, loss="zloss", loss_kwargs=LOSS_KW["zloss"], bias=False,
                               dtype=torch.float64, stabiliser={"check_every": 3})
    g2.load_state_dict(f.state_dict())
    assert g2.lr == 0.03
    for H, idx in data[6:]:
        H1, H2 = H.clone().requires_grad_(), H.clone().requires_grad_()
        f(H1, idx).backward()
        g2(H2, idx).backward()
        assert torch.equal(H1.grad, H2.grad)
    for k, v in f.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, g2.state_dict()[k]), k








def test_bad_constructor_arguments():
    for kw, msg in [({"num_classes": 0}, "num_classes"), ({"reduction": "max"}, "reduction"),
                    ({"stabiliser": {"sv_min": 1.5}}, "sv_min"), ({"stabiliser": {"sv_method": "eig"}}, "sv_method"),
                    ({"loss": "nope"}, "unknown"), ({"dtype": torch.float16}, "float32"),
                    ({"stabiliser": {"check_every": -1}}, "check_every"),
                    ({"stabiliser": {"check_evry": 5}}, "unknown stabiliser setting"),
                    ({"stabiliser": 5}, "stabiliser must be")]:
        args = {"num_classes": 10, "hidden_dim": 4, **kw}
        with pytest.raises((ValueError, TypeError), match=msg):
            FactoredSphericalHead(**args)








def test_reset_weight_and_weight_round_trip():
    f = FactoredSphericalHead(num_classes=30, hidden_dim=5, bias=True, dtype=torch.float64)
    W = torch.randn(30, 6, dtype=torch.float64)
    f.reset_weight(W)
    torch.testing.assert_close(f.weight(), W)
    torch.testing.assert_close(f.Q, W.T @ W)
    torch.testing.assert_close(f.wbar, W.sum(0))


@pytest.mark.parametrize("sync_every", [1, 4])
def test_train_step_equals_forward_and_backward(sync_every):
    a = deferred(sync_every=sync_every, weight_decay=0.01)
    b = copy.deepcopy(a)
    for step in range(6):
        a.lr = b.lr = 0.05 / (1 + step)  # a schedule: the device lr follows
        H, idx = batch(5, d, D, 3)
        Ha = H.clone().requires_grad_()
        loss_a = a(Ha, idx)
        loss_a.backward()
        loss_b, dH_b = b.train_step(H.clone(), idx)
        assert torch.equal(loss_a.detach(), loss_b) and torch.equal(Ha.grad, dH_b)
    assert state(a) == state(b) and int(b.steps) == 6


@pytest.mark.parametrize("sync_every", [1, 4])
def test_fused_step_mode_trains_like_autograd(sync_every):
    """step="fused": the update runs in the forward, backward only hands dL/dH on, and the
    head ends bit-identical to the autograd step."""
    a = deferred(sync_every=sync_every, weight_decay=0.01)
    b = copy.deepcopy(a)
    b.step = "fused"
    for i in range(6):
        H, idx = batch(5, d, D, 3)
        Ha, Hb = H.clone().requires_grad_(), H.clone().requires_grad_()
        loss_a, loss_b = a(Ha, idx), b(Hb, idx)
        assert int(b.steps) == i + 1 and int(a.steps) == i  # b stepped already
        loss_a.backward()
        loss_b.backward()
        assert torch.equal(loss_a.detach(), loss_b.detach()) and torch.equal(Ha.grad, Hb.grad)
    assert state(a) == state(b)


def test_step_modes_are_checked():
    head = deferred()
    with pytest.raises(ValueError, match="step must be one of"):
        head.step = "eager"
    head.step = "cuda_graph"  # on a CPU head the first training step refuses, untouched
    before = state(head)
    with pytest.raises(ValueError, match="CUDA device"):
        head(*batch(5, d, D, 3)[:1], batch(5, d, D, 3)[1])
    assert state(head) == before and int(head.steps) == 0
    assert NaiveSphericalHead.step_modes == ("autograd",)


def test_a_bad_batch_saved_before_the_read_that_reports_it_is_reported_after_the_resume():
    """Under device flags a bad batch's step is void and reported at the next read; a state saved
    between the two (``bad_input`` in the extra state, a device scalar: no host read) makes the
    resumed head raise at that read as the saved one does. A bad ``bad_input`` is refused in one line."""
    torch.manual_seed(0)
    head = deferred(sync_every=8)
    H, idx = batch(3, d, D, 2)
    bad = idx.clone()
    bad[1, 0] = D + 2
    for targets in (idx, bad, idx):
        head(H.clone().requires_grad_(), targets).backward()
    saved = copy.deepcopy(head.state_dict())
    resumed = deferred(sync_every=8)
    resumed.load_state_dict(saved)
    for h in (head, resumed):
        with pytest.raises(ValueError, match=f"the batch of step 2 had target ids outside \\[0, {D}\\)"):
            h.sync()
        h.sync()  # reported once
    assert int(resumed.skipped_nonfinite) == int(head.skipped_nonfinite) == 1
    c = deferred(sync_every=8)
    before = state_of(c)
    for wrong in (torch.tensor(-1), torch.tensor(0.5), [2]):
        with pytest.raises(ValueError, match="bad_input") as err:
            c.load_state_dict({**saved, "_extra_state": {**saved["_extra_state"], "bad_input": wrong}})
        assert "\n" not in str(err.value)
        assert_untouched(c, before)
