"""The exact repairs of the factored head (stabiliser.py): each keeps W, and the head
stays exact against the naive head through them."""
import dataclasses
import warnings

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.spherical.stabiliser import Stabiliser
from lst_lightning.spherical.exact_step import eig_bounds

from head_pairs import batch, make_pair, rel, run_steps, step_both


@pytest.mark.parametrize("inverse", ["woodbury", "solve", "products"])
@pytest.mark.parametrize("sv_method", ["power", "svd"])
def test_inverse_routes_and_sv_methods(inverse, sv_method):
    # m > d takes the solve with "auto" on a CPU; here every route is forced.
    # device flags read every 8 steps: the repairs run at the reads
    f, n = make_pair("mse", d=6, lr=0.03, stabiliser={"inverse": inverse, "sv_method": sv_method}, sync_every=8)
    run_steps(f, n, steps=40, m=9, K=2)
    assert int(f.checks) > 0 and int(f.sv_fixes) > 0, f.stats()  # mse shrinks U: repairs must run



def test_singular_step_is_folded_and_stays_exact():
    # m = 1, squared error: B = I - 2 lr h h^T is exactly singular at lr = 1 / (2 ||h||^2).
    f, n = make_pair("mse", lr=0.01, sync_every=1)  # the flags read after each step
    for _ in range(3):
        H, idx = batch(1, 8, 60, 1)
        Hx = H.clone()
        f.lr = n.lr = 1.0 / (2.0 * float(Hx.pow(2).sum()))
        assert max(step_both(f, n, H, idx)) < 1e-9
    assert int(f.folds) == 3, f.stats()
    torch.testing.assert_close(f.U, torch.eye(8, dtype=torch.float64))



def test_large_steps_trigger_conditioning_checks_before_the_period():
    f, n = make_pair("mse", d=8, lr=0.08, stabiliser={"check_every": 0, "uinv_refresh_every": 0}, sync_every=1)
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



@pytest.mark.parametrize("sv_method", ["power", "svd"])
def test_several_fixes_take_one_pass_over_v_and_keep_w(monkeypatch, sv_method):
    """Three singular values out of range, at most 8 fixes: U's are fixed one by one (power)
    or together (svd), V's transforms composed and applied in ONE pass; W unchanged."""
    import lst_lightning.spherical.stabiliser as stab
    f, _ = make_pair("zloss", d=8, stabiliser={"sv_method": sv_method})
    W = f.weight()
    S = torch.tensor([0.05, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0], dtype=torch.float64)
    R = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0]
    U = R @ torch.diag(S) @ torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0].T
    f.U.copy_(U)
    f.Uinv.copy_(torch.linalg.inv(U))
    f.V.copy_(torch.linalg.solve(U.T, (W - f.omega).T).T)  # keeps W = V U + 1 omega^T
    passes = []
    blocks = stab.in_place_blocks
    monkeypatch.setattr(stab, "in_place_blocks", lambda X: passes.append(1) or blocks(X))
    f.stabilise()
    assert len(passes) == 1 and int(f.sv_fixes) >= 3 and int(f.unfactorizations) == 0, f.stats()
    torch.testing.assert_close(f.weight(), W, rtol=1e-10, atol=1e-10)
    sig = torch.linalg.svdvals(f.U)
    assert f.stabiliser.sv_min - 1e-6 <= float(sig.min()) and float(sig.max()) <= f.stabiliser.sv_max + 1e-6
    torch.testing.assert_close(f.Uinv @ f.U, torch.eye(8, dtype=torch.float64))


@pytest.mark.parametrize("sv_method", ["power", "svd"])
@pytest.mark.parametrize("scale", [1e-30, 1e-7, 1e5])
def test_a_spectrum_drifted_out_of_the_band_is_rescaled_as_one_in_float32(sv_method, scale):
    """Weight decay scales U by c = 1 - lr weight_decay every step, and V grows as U shrinks:
    U's singular values all 1e-7 (or 1e5) of what they were, float32. A rank-one fix by a factor
    of 1e7 forms V's new part as the difference of two numbers near 1 and loses every digit
    (W off by about 100 %); the repair rescales U and V by a scalar first, which keeps W to
    float32's rounding, and then needs no rank-one fix."""
    f = FactoredSphericalHead(60, 8, loss="zloss", dtype=torch.float32, stabiliser={"sv_method": sv_method})
    R = torch.linalg.qr(torch.randn(9, 9, dtype=torch.float64))[0]
    U = scale * (R @ torch.diag(torch.linspace(0.7, 1.4, 9, dtype=torch.float64)) @ R.T)  # cond(U) 2, in the band once rescaled
    W = f.weight().double()
    f.U.copy_(U)
    f.Uinv.copy_(torch.linalg.inv(U))
    f.V.copy_(torch.linalg.solve(U.T, (W - f.omega.double()).T).T)  # W = V U + 1 omega^T
    W = f.weight().double()  # as float32 holds it
    f.stabilise()
    assert rel(f.weight(), W) < 1e-6, rel(f.weight(), W)
    sig = torch.linalg.svdvals(f.U.double())
    assert f.stabiliser.sv_min <= float(sig.min()) and float(sig.max()) <= f.stabiliser.sv_max
    assert (int(f.sv_fixes), int(f.unfactorizations)) == (1, 0), f.stats()  # the rescale alone


def test_weight_decay_that_would_take_u_out_of_float32_runs_the_check_early():
    """lr weight_decay = 0.6: U shrinks by 0.4 a step, 0.4^100 = 1.6e-40 at the scheduled check
    (check_every = 100), past float32's smallest normal number. Small steps of the squared error
    carry no cond(U) past its trigger and fold nothing, so only the decay itself brings the check
    forward (``Repairs.decay_period``: every 47 steps, before U passes 1e-19); the head stays with
    the float64 naive head through 150 steps."""
    f, n = make_pair("mse", lr=1.0, weight_decay=0.6, dtype=torch.float32, ref_dtype=torch.float64,
                     scale=0.3, sync_every=1)
    for _ in range(150):
        H, idx = batch(5, 8, 60, 2)
        step_both(f, n, 1e-3 * H, idx)
    assert f.repairs.decay_period(f) == 47
    assert (int(f.checks), int(f.folds), int(f.skipped_nonfinite)) == (150 // 47 + 150 // 100, 0, 0), f.stats()
    assert rel(f.weight(), n.weight()) < 1e-6, rel(f.weight(), n.weight())


def test_bookkeeping_refresh_is_exact():
    f, n = make_pair("zloss", lr=0.05, stabiliser={"q_refresh_every": 7}, sync_every=1)
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


@pytest.mark.parametrize("preconditioned", [False, True])
@pytest.mark.parametrize("m,d", [(3, 8), (12, 5)])
def test_eig_bounds_bound_the_eigenvalues(m, d, preconditioned):
    """Every eigenvalue of A = H^T diag(kappa) H P lies in [-rho_neg, rho_pos] (``eig_bounds``),
    on fresh random inputs of both signs over five decades of kappa, P symmetric positive definite
    or I: from the d x d A (h^T P h bounded by lambda_max(P) ||h||^2) and from the m x m
    diag(kappa) H P H^T (Woodbury's, h^T P h exact). Without P, neither bound is above A's
    Frobenius norm."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        H = torch.randn(m, d, generator=g, dtype=torch.float64)
        kappa = torch.randn(m, generator=g, dtype=torch.float64) * 10 ** (seed % 5 - 3)
        P = torch.eye(d, dtype=torch.float64)
        if preconditioned:
            M = torch.randn(d, d, generator=g, dtype=torch.float64)
            P = torch.linalg.inv(M @ M.T / d + 0.1 * torch.eye(d, dtype=torch.float64))
        A = (kappa[:, None] * H).T @ H @ P
        ev = torch.linalg.eigvals(A).real
        G = H @ P @ H.T
        forms = [(A, H.pow(2).sum(1) * torch.linalg.eigvalsh(P).max()), (kappa[:, None] * G, G.diagonal())]
        slack = 1e-12 * float(torch.linalg.matrix_norm(A))  # LAPACK's rounding of the eigenvalues (0 as 1e-16)
        for form, sq in forms:
            rho_pos, rho_neg = eig_bounds(form, sq, kappa)
            assert float(ev.max()) <= float(rho_pos) + slack
            assert -float(ev.min()) <= float(rho_neg) + slack
            if not preconditioned:
                assert max(float(rho_pos), float(rho_neg)) <= float(torch.linalg.matrix_norm(A)) * (1 + 1e-12)


def test_stabiliser_settings_from_a_config_dict():
    assert Stabiliser.of(None) == Stabiliser() and Stabiliser.of({"check_every": 5}).check_every == 5
    s = Stabiliser(sv_method="svd")
    assert Stabiliser.of(s) is s
    with pytest.raises(ValueError, match="fold_tol"):
        Stabiliser(fold_tol=1.0)
    with pytest.raises(ValueError, match=r"unknown stabiliser setting\(s\) \['sync_every'\]"):
        Stabiliser.of({"sync_every": 4})  # a head setting, not a repair's
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.sv_min = 0.1  # a head's settings change only by a new Stabiliser


def _large_gq_step(dtype, inverse, sync_every=1):
    """A head and a batch whose g_q is large (lr 8, the loss scaled by 1e4 upstream): the cheap
    bounds cannot rule out a nearly singular B."""
    f, _ = make_pair("zloss", d=8, lr=8.0, dtype=dtype, stabiliser={"inverse": inverse}, sync_every=sync_every)
    H, idx = batch(4 if inverse == "woodbury" else 12, 8, 60, 2)
    return f, (3.0 * H).to(dtype), idx


GQ_SCALE = 1e4


@pytest.mark.parametrize("sync_every", [1, 2])
@pytest.mark.parametrize("inverse", ["woodbury", "solve", "products"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_gq_steps_never_raise(dtype, inverse, sync_every):
    """The step computes no eigenvalues: a step is taken, folded or masked out, never raised."""
    f, H, idx = _large_gq_step(dtype, inverse, sync_every=sync_every)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped steps' warnings
        for _ in range(4):
            (GQ_SCALE * f(H.clone().requires_grad_(), idx)).backward()
    s = f.stats()
    assert torch.isfinite(f.weight()).all() and s["steps"] + s["skipped_nonfinite"] == 4, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_probes_crash_setting_never_raises(dtype):
    """A setting that crashed LAPACK: loss=sampled with the Gramian penalty at gram = 1 and head lr 8 (the
    penalty's g_q makes B expand W; LAPACK raised on the ill-conditioned result). Every step is
    taken, folded or skipped and counted: none raises, W stays finite."""
    torch.manual_seed(0)
    f = FactoredSphericalHead(500, 16, loss="sampled", loss_kwargs=dict(gram=1.0), lr=8.0, dtype=dtype,
                              negatives=dict(num=16, seed=1), sync_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped steps' warnings
        for _ in range(10):
            f(3.0 * torch.randn(64, 16, dtype=dtype, requires_grad=True), torch.randint(0, 500, (64, 2))).backward()
    s = f.stats()
    assert s["steps"] + s["skipped_nonfinite"] == 10, s
    assert torch.isfinite(f.weight()).all()


def test_failed_svd_in_stabilise_folds_u_into_v(monkeypatch):
    f, _ = make_pair("zloss", d=8, stabiliser={"sv_method": "svd"})
    R = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0]
    f.U.copy_(R * 3.0)
    f.Uinv.copy_(torch.linalg.inv(f.U))
    W = f.weight()

    def fail(*a, **k):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", fail)
    f.stabilise()
    torch.testing.assert_close(f.weight(), W, rtol=1e-12, atol=1e-12)
    s = f.stats()
    assert s["eig_failures"] == 1 and s["unfactorizations"] == 1, s
    torch.testing.assert_close(f.U, torch.eye(8, dtype=torch.float64))
