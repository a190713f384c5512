"""The factored head against the naive explicit-W head, step after step, and its safety."""
import copy
import warnings

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead
from lst_lightning.losses import LOSSES

from head_pairs import LOSS_KW, batch, make_pair, rel, run_steps, step_both



@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,K", [(1, 1), (7, 3)])
def test_exact_float64(loss, bias, m, K):
    f, n = make_pair(loss, bias=bias, lr=0.05, weight_decay=0.01)
    run_steps(f, n, steps=40, m=m, K=K, tol=1e-9)
    assert int(f.steps) == 40


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


@pytest.mark.parametrize("woodbury", ["always", "never"])
@pytest.mark.parametrize("sv_method", ["power", "svd"])
def test_inverse_paths_and_sv_methods(woodbury, sv_method):
    # m > d exercises the direct inverse with "auto"; here both paths are forced.
    f, n = make_pair("mse", d=6, lr=0.03, stabiliser={"woodbury": woodbury, "sv_method": sv_method})
    run_steps(f, n, steps=40, m=9, K=2)
    assert int(f.checks) > 0 and int(f.sv_fixes) > 0, f.stats()  # mse shrinks U: repairs must run


def test_singular_step_is_folded_and_stays_exact():
    # m = 1, squared error: B = I - 2 lr h h^T is exactly singular at lr = 1 / (2 ||h||^2).
    f, n = make_pair("mse", lr=0.01)
    for _ in range(3):
        H, idx = batch(1, 8, 60, 1)
        Hx = H.clone()
        f.lr = n.lr = 1.0 / (2.0 * float(Hx.pow(2).sum()))
        assert max(step_both(f, n, H, idx)) < 1e-9
    assert int(f.folds) == 3 and int(f.eig_checks) == 3, f.stats()
    torch.testing.assert_close(f.U, torch.eye(8, dtype=torch.float64))


def test_large_steps_trigger_conditioning_checks_before_the_period():
    f, n = make_pair("mse", d=8, lr=0.08, stabiliser={"check_every": 0, "uinv_refresh_every": 0})
    run_steps(f, n, steps=60, m=4, K=1)
    s = f.stats()
    assert s["checks"] > 0 and s["sv_fixes"] > 0, s  # the conditioning trigger alone fired
    sig = torch.linalg.svdvals(f.U)
    assert float(sig.max() / sig.min()) < 4 * f.stabiliser.cond_trigger


@pytest.mark.parametrize("sv_method", ["power", "svd"])
def test_stabilise_repairs_an_ill_conditioned_u_without_changing_w(sv_method):
    f, _ = make_pair("zloss", d=8, stabiliser={"sv_method": sv_method, "max_sv_fixes": 2})
    W = f.weight()
    S = torch.tensor([1e-3, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0, 30.0], dtype=torch.float64)
    R = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0]
    U = R @ torch.diag(S) @ R.T
    f.U.copy_(U)
    f.Uinv.copy_(torch.linalg.inv(U))
    f.V.copy_(torch.linalg.solve(U.T, (W - f.omega).T).T)  # keeps W = V U + 1 omega^T
    f.stabilise()
    torch.testing.assert_close(f.weight(), W, rtol=1e-9, atol=1e-9)
    sig = torch.linalg.svdvals(f.U)
    assert f.stabiliser.sv_min - 1e-6 <= float(sig.min()) and float(sig.max()) <= f.stabiliser.sv_max + 1e-6
    assert int(f.unfactorizations) == 1  # three out of range > max_sv_fixes = 2
    torch.testing.assert_close(f.Uinv @ f.U, torch.eye(8, dtype=torch.float64))


def test_bookkeeping_refresh_is_exact():
    f, n = make_pair("zloss", lr=0.05, stabiliser={"q_refresh_every": 7})
    run_steps(f, n, steps=20, m=3, K=2)
    W = f.weight()
    torch.testing.assert_close(f.Q, W.T @ W)
    torch.testing.assert_close(f.wbar, W.sum(0))
    assert int(f.q_refreshes) == 2


@pytest.mark.parametrize("m", [4, 16])  # Woodbury updates of U^-1, and direct solves
def test_long_float32_run_keeps_uinv_accurate(m):
    f, _ = make_pair("zloss", D=500, d=16, dtype=torch.float32, lr=0.05)
    for _ in range(400):
        H, idx = batch(m, 16, 500, 1, dtype=torch.float32)
        f(H.requires_grad_(), idx).backward()
    if not bool(f.uinv_fresh):
        f.stabilise()
    eye = torch.eye(16)
    assert float((f.Uinv @ f.U - eye).abs().max()) < 1e-4
    W = f.weight().double()
    assert rel(f.Q, W.T @ W) < 1e-4


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


def test_eval_mode_and_no_grad_do_not_update():
    f, _ = make_pair("zloss")
    before = copy.deepcopy(f.state_dict())
    H, idx = batch(4, 8, 60, 1)
    f.eval()
    f(H.requires_grad_(), idx)
    f.train()
    with torch.no_grad():
        f(H, idx)
    for k, v in f.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k


def test_state_dict_round_trip_is_bit_identical():
    f, _ = make_pair("zloss", lr=0.05, stabiliser={"check_every": 3})
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 8, generator=g, dtype=torch.float64), torch.randint(0, 60, (5, 2), generator=g))
            for _ in range(12)]
    for H, idx in data[:6]:
        f(H.clone().requires_grad_(), idx).backward()
    f.lr = 0.03
    other = FactoredSphericalHead(num_classes=60, hidden_dim=8, loss="zloss", dtype=torch.float64)
    before = state_of(other)
    with pytest.raises(ValueError, match="saved with loss"):  # zloss a=0.5, b=2 is not the default
        other.load_state_dict(f.state_dict())
    assert_untouched(other, before)
    g2 = FactoredSphericalHead(num_classes=60, hidden_dim=8, loss="zloss", loss_kwargs=LOSS_KW["zloss"],
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


def state_of(head):
    return {k: v.clone() for k, v in head.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_untouched(head, before):
    for k, v in head.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), f"{k} changed"


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_bad_input_is_refused_and_state_untouched(cls):
    head = cls(num_classes=20, hidden_dim=4, loss="zloss")
    before = state_of(head)
    H = torch.randn(3, 4, requires_grad=True)
    ok = torch.tensor([1, 2, 3])
    cases = [
        ((H, torch.tensor([1, 20, 3])), ValueError, "outside"),
        ((H, torch.tensor([1, -2, 3])), ValueError, "outside"),
        ((torch.randn(3, 5), ok), ValueError, "hidden_dim"),
        ((torch.randn(3), ok), ValueError, "2-D"),
        ((torch.randn(0, 4), torch.zeros(0, dtype=torch.long)), ValueError, "empty"),
        ((H, ok.float()), TypeError, "int64"),
        ((H, torch.tensor([1, 2]),), ValueError, "shape"),
        ((H.int(), ok), TypeError, "floating"),
        ((torch.randn(3, 4, device="meta"), ok), ValueError, "meta"),
        ((H, ok, torch.ones(3, 2)), ValueError, "target_val"),
        ((H, ok, torch.ones(3, dtype=torch.long)), TypeError, "target_val"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            head(*args)
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="lr"):
            head.lr = bad
    with pytest.raises(ValueError, match="weight_decay"):
        head.weight_decay = -0.1
    head.lr, head.weight_decay = 10.0, 0.5
    with pytest.raises(ValueError, match="flip"):
        head(H, ok)
    with pytest.raises(ValueError, match="shape"):
        head.reset_weight(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="non-finite"):
        head.reset_weight(torch.full((20, 4), float("nan")))
    assert_untouched(head, before)


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


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_non_finite_steps_are_skipped_counted_and_warned_sparingly(cls):
    head = cls(num_classes=20, hidden_dim=4, loss="spherical_softmax")
    before = state_of(head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            H = torch.randn(3, 4)
            H[1, 2] = float("nan") if i % 2 else float("inf")
            H.requires_grad_()
            head(H, torch.tensor([1, 2, 3])).backward()
            assert torch.equal(H.grad, torch.zeros_like(H))
        val = torch.tensor([1.0, float("inf"), 1.0])
        head(torch.randn(3, 4, requires_grad=True), torch.tensor([1, 2, 3]), val).backward()
    assert int(head.skipped_nonfinite) == 11
    assert sum("non-finite" in str(w.message) for w in caught) == 4  # at 1, 2, 4, 8
    before["skipped_nonfinite"] = head.skipped_nonfinite
    assert_untouched(head, before)


def test_two_forwards_before_backward_is_an_error():
    f, _ = make_pair("zloss")
    H, idx = batch(3, 8, 60, 1)
    L1 = f(H.clone().requires_grad_(), idx)
    L2 = f(H.clone().requires_grad_(), idx)
    L2.backward()
    with pytest.raises(RuntimeError, match="no gradient accumulation"):
        L1.backward()


def test_hidden_without_grad_still_updates_the_head():
    f, n = make_pair("taylor_softmax", lr=0.05)
    H, idx = batch(4, 8, 60, 2)
    f(H, idx).backward()
    n(H, idx).backward()
    assert rel(f.weight(), n.weight()) < 1e-12 and int(f.steps) == 1


def test_reset_weight_and_weight_round_trip():
    f = FactoredSphericalHead(num_classes=30, hidden_dim=5, bias=True, dtype=torch.float64)
    W = torch.randn(30, 6, dtype=torch.float64)
    f.reset_weight(W)
    torch.testing.assert_close(f.weight(), W)
    torch.testing.assert_close(f.Q, W.T @ W)
    torch.testing.assert_close(f.wbar, W.sum(0))
