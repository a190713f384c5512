"""U_new^-1 by d x d products alone (inverse_update.py; ``Stabiliser.inverse="products"``, the
GPU's route): the inverse itself against LAPACK's, its rule for the number of factors, and
the factored head on that route equal to the naive head step for step, with host checks
and with device flags, falling back to the solve (host) or skipping the step (device flags)
where the products cannot reach rounding."""
import math

import pytest
import torch

from lst_lightning.spherical import inverse_update as iu
from lst_lightning.spherical import exact_step
from lst_lightning.spherical.stabiliser import Repairs, Stabiliser

from head_pairs import deferred, make_pair, run_steps, step_both


def symmetric_with_radius(d, rho, generator):
    """A random symmetric d x d matrix with spectral radius rho, eigenvalues of both signs."""
    Qm, _ = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=generator))
    ev = torch.empty(d, dtype=torch.float64).uniform_(-rho, rho, generator=generator)
    ev[0] = rho if d % 2 else -rho
    return (Qm * ev) @ Qm.T


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.8])
@pytest.mark.parametrize("c", [1.0, 0.97])
@pytest.mark.parametrize("d", [7, 33])
def test_the_products_give_the_inverse(rho, c, d):
    g = torch.Generator().manual_seed(d + int(100 * rho))
    U = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, dtype=torch.float64, generator=g) / math.sqrt(d)
    A = symmetric_with_radius(d, rho, g)
    U_new = c * U @ (torch.eye(d, dtype=torch.float64) - A)
    cond = float(torch.linalg.cond(U))
    k = iu.neumann_factors(rho, cond, torch.float64)
    assert k is not None
    Y, residual = iu.uinv_by_products(U_new, torch.linalg.inv(U), A, c, k)
    exact = torch.linalg.inv(U_new)
    assert float((Y - exact).norm() / exact.norm()) < 1e-12
    assert float(residual) <= iu.residual_tolerance(torch.float64)


def test_the_rule_takes_the_fewest_factors_that_reach_the_tolerance():
    for dtype in (torch.float32, torch.float64):
        tol = iu.residual_tolerance(dtype)
        assert tol == pytest.approx(torch.finfo(dtype).eps ** 0.25)
        for cond in (1.0, 4.0):
            ks = []
            for rho in (0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.8):
                k = iu.neumann_factors(rho, cond, dtype)
                if k is None:  # past MAX_FACTORS: even 2^6 = 64 powers leave too much
                    assert cond * rho ** (2 ** iu.MAX_FACTORS) > tol
                    continue
                assert cond * rho ** (2 ** k) <= tol * (1 + 1e-9)
                assert k == 1 or cond * rho ** (2 ** (k - 1)) > tol  # one factor fewer would not do
                ks.append(k)
            assert ks == sorted(ks) and ks[0] == 1
    assert iu.neumann_factors(1.0, 1.0, torch.float32) is None
    assert iu.neumann_factors(math.nan, 1.0, torch.float32) is None
    assert iu.neumann_factors(0.2, math.inf, torch.float32) is None


class Spy:
    """Counts the calls of the products route and of the LU solve through the step module."""

    def __init__(self, monkeypatch):
        self.products = self.solves = 0
        products, solve = exact_step.uinv_by_products, exact_step.solve_right

        def count_products(*a, **k):
            self.products += 1
            return products(*a, **k)

        def count_solves(*a, **k):
            self.solves += 1
            return solve(*a, **k)

        monkeypatch.setattr(exact_step, "uinv_by_products", count_products)
        monkeypatch.setattr(exact_step, "solve_right", count_solves)


@pytest.mark.parametrize("loss", ["zloss", "mse", "spherical_softmax", "sampled"])
@pytest.mark.parametrize("m", [3, 16])  # below d/2 (where a CPU takes Woodbury) and above d
def test_the_products_route_equals_the_naive_head(monkeypatch, loss, m):
    torch.manual_seed(1)
    spy = Spy(monkeypatch)
    f, n = make_pair(loss, bias=True, lr=0.05, weight_decay=0.01, stabiliser={"inverse": "products"}, sync_every=1)
    run_steps(f, n, steps=25, m=m, K=3)  # K > 1, padding, classes repeated within and across rows
    # every step by the products (the flags read after each; a step past their reach folds)
    assert spy.products == 25 and spy.solves == 0, (spy.products, f.stats())
    assert f.uinv_fresh and int(f.skipped_nonfinite) == 0
    torch.testing.assert_close(f.Uinv @ f.U, torch.eye(f.width, dtype=torch.float64), atol=1e-10, rtol=0)


def test_device_flags_on_the_products_route_equal_the_naive_head(monkeypatch):
    torch.manual_seed(2)
    spy = Spy(monkeypatch)
    f, n = make_pair("zloss", bias=True, lr=0.05, weight_decay=0.01)
    g = deferred(loss_kwargs=f.loss_fn.hparams(), weight_decay=0.01, sync_every=3,
                 stabiliser={"inverse": "products"})
    g.reset_weight(f.weight())
    run_steps(g, n, steps=30, m=16, K=3)
    assert spy.products == 30 and spy.solves == 0
    assert int(g.steps) == 30 and int(g.skipped_nonfinite) == 0


@pytest.mark.parametrize("sync_every", [1, 2])  # the same device part, the flags read after the step or later
def test_past_the_products_reach_a_step_under_device_flags_is_folded_on_the_device_and_exact(sync_every):
    """rho = 1.2: the Neumann series diverges and the bounds cannot rule out B/c near singular, so
    the device folds the step into V (no solve, no host read); the step is taken, exact."""
    f, n = make_pair("mse", d=8, lr=0.2, stabiliser={"inverse": "products"}, sync_every=sync_every)
    H = torch.zeros(1, 8, dtype=torch.float64)
    H[0, 0] = math.sqrt(3.0)
    assert max(step_both(f, n, H, torch.tensor([[3]]))) < 1e-12
    assert int(f.steps) == 1 and int(f.skipped_nonfinite) == 0 and int(f.folds) == 1
    torch.testing.assert_close(f.U, torch.eye(8, dtype=torch.float64), rtol=0, atol=0)


def test_the_setting_and_its_former_name():
    assert Stabiliser().inverse == "auto"
    assert Stabiliser.of({"woodbury": "always"}).inverse == "woodbury"
    assert Stabiliser.of({"woodbury": "never"}).inverse == "solve"
    with pytest.raises(ValueError, match="inverse must be one of"):
        Stabiliser(inverse="lu")


def test_auto_takes_woodbury_or_the_solve_on_a_cpu():
    f, _ = make_pair("zloss", d=8)
    assert exact_step.step_route(f.plan, 4).name == "woodbury" and exact_step.step_route(f.plan, 5).name == "solve"


def test_new_repairs_make_the_plan_again():
    """The plan holds the repairs' U^-1 route and fold thresholds: a head given other repairs steps by them."""
    f, _ = make_pair("zloss", d=8)
    f.repairs = Repairs(Stabiliser(inverse="products", fold_tol=0.2, fold_cond=8.0))
    assert (f.plan.inverse, f.plan.fold_tol, f.plan.fold_cond) == ("products", 0.2, 8.0)
    assert exact_step.step_route(f.plan, 4).name == "products"


@pytest.mark.parametrize("loss", ["zloss", "sampled"])
def test_float32_on_the_products_route_stays_with_the_float64_naive_head(monkeypatch, loss):
    """The GPU runs the products route in float32 (a residual tolerance of eps^(1/4) = 0.019
    before the Newton-Schulz steps): as close to the float64 naive head as the LU route is
    (tests/spherical/test_cuda.py's bound), here on the CPU."""
    torch.manual_seed(4)
    spy = Spy(monkeypatch)
    f, n = make_pair(loss, D=3000, d=64, bias=True, dtype=torch.float32, ref_dtype=torch.float64, lr=0.02,
                     weight_decay=0.001, stabiliser={"inverse": "products"})
    run_steps(f, n, steps=50, m=33, K=3, classes=200, tol=2e-4)
    assert spy.products >= 45 and spy.products + spy.solves + int(f.folds) == 50, (spy.products, f.stats())


def test_the_adaptive_rule_takes_the_factors_of_four_times_the_rho_seen():
    f32 = torch.float32
    assert iu.adaptive_factors(0.0, 1.0, 4.0, False, f32) == iu.ADAPTIVE_MIN_FACTORS == 2
    assert iu.adaptive_factors(0.045, 1.0, 4.0, False, f32) == 2  # the default run's largest at 10^6
    assert iu.adaptive_factors(0.1, 1.0, 4.0, False, f32) == 3
    assert iu.adaptive_factors(0.1, 1.0, 4.0, True, f32) == iu.MAX_FACTORS  # after a skipped step
    assert iu.adaptive_factors(0.3, 1.0, 4.0, False, f32) == iu.MAX_FACTORS  # 4 rho past the products' reach
    assert iu.adaptive_factors(float("nan"), 1.0, 4.0, False, f32) == iu.MAX_FACTORS


class FactorSpy:
    """The factors each call of the products route took."""

    def __init__(self, monkeypatch):
        self.factors = []
        products = exact_step.uinv_by_products

        def spy(U_new, Uinv, A, c, factors):
            self.factors.append(factors)
            return products(U_new, Uinv, A, c, factors)

        monkeypatch.setattr(exact_step, "uinv_by_products", spy)


def test_device_flags_with_adaptive_factors_equal_the_naive_head(monkeypatch):
    """``neumann="adaptive"``: six factors until the first read of the flags, then fewer, read
    by read; step for step the naive head's, nothing skipped."""
    torch.manual_seed(3)
    spy = FactorSpy(monkeypatch)
    f, n = make_pair("zloss", bias=True, lr=0.05, weight_decay=0.01)
    g = deferred(loss_kwargs=f.loss_fn.hparams(), weight_decay=0.01, sync_every=3,
                 stabiliser={"inverse": "products", "neumann": "adaptive"})
    g.reset_weight(f.weight())
    run_steps(g, n, steps=30, m=16, K=3)
    assert spy.factors[:3] == [iu.MAX_FACTORS] * 3 and min(spy.factors[3:]) < iu.MAX_FACTORS
    assert len(spy.factors) == 30 and int(g.steps) == 30 and int(g.skipped_nonfinite) == 0


def test_max_keeps_six_factors_under_device_flags(monkeypatch):
    """``neumann="max"``: six factors at every step, reads or not; the default is "adaptive"."""
    spy = FactorSpy(monkeypatch)
    g = deferred(sync_every=2, stabiliser={"inverse": "products", "neumann": "max"})
    for _ in range(6):
        H, idx = torch.randn(8, g.hidden_dim, dtype=torch.float64), torch.randint(0, g.num_classes, (8, 1))
        g.train_step(H, idx)
    assert Stabiliser().neumann == "adaptive" and spy.factors == [iu.MAX_FACTORS] * 6


def test_the_default_adapts_the_factors_under_device_flags(monkeypatch):
    """The default rule: six factors until the first read of the flags, then those of the rho seen."""
    spy = FactorSpy(monkeypatch)
    g = deferred(sync_every=2, stabiliser={"inverse": "products"})
    for _ in range(6):
        H, idx = torch.randn(8, g.hidden_dim, dtype=torch.float64) * 0.05, torch.randint(0, g.num_classes, (8, 1))
        g.train_step(H, idx)
    assert spy.factors[:2] == [iu.MAX_FACTORS] * 2 and max(spy.factors[2:]) < iu.MAX_FACTORS


def test_a_step_past_the_factors_reach_is_folded_and_the_factors_go_back_to_the_maximum(monkeypatch):
    """Four times the rho seen may not cover the next steps: a step whose products miss the
    residual is folded into V on the device (exact, not skipped), and the next read, which
    finds its rho bound, takes the maximum again."""
    spy = FactorSpy(monkeypatch)
    g, n = make_pair("mse", d=8, lr=0.2, sync_every=2, stabiliser={"inverse": "products", "neumann": "adaptive"})
    small = torch.randn(4, g.hidden_dim, dtype=torch.float64) * 0.05
    for _ in range(4):  # two reads of small steps: the factors fall to the least
        assert max(step_both(g, n, small, torch.randint(0, g.num_classes, (4, 1)))) < 1e-12
    assert g.step_checks.factors == iu.ADAPTIVE_MIN_FACTORS
    H = torch.zeros(1, g.hidden_dim, dtype=torch.float64)
    H[0, 0] = math.sqrt(3.0)  # rho = 1.2: the series diverges, the residual fails, the step is folded
    assert max(step_both(g, n, H, torch.tensor([[3]]))) < 1e-12
    assert max(step_both(g, n, small[:1], torch.tensor([[5]]))) < 1e-12  # the read
    assert int(g.skipped_nonfinite) == 0 and int(g.folds) == 1 and g.step_checks.factors == iu.MAX_FACTORS
    assert spy.factors[-2:] == [iu.ADAPTIVE_MIN_FACTORS, iu.ADAPTIVE_MIN_FACTORS]
    with pytest.raises(ValueError, match="neumann must be one of"):
        Stabiliser(neumann="fewest")


def test_a_checkpoint_keeps_the_adaptive_factors():
    g = deferred(sync_every=2, stabiliser={"inverse": "products", "neumann": "adaptive"})
    for _ in range(4):
        g.train_step(torch.randn(4, g.hidden_dim, dtype=torch.float64) * 0.05, torch.randint(0, g.num_classes, (4, 1)))
    chosen = g.step_checks.factors
    assert chosen < iu.MAX_FACTORS
    fresh = deferred(sync_every=2, stabiliser={"inverse": "products", "neumann": "adaptive"})
    assert fresh.step_checks.factors == iu.MAX_FACTORS
    fresh.load_state_dict(g.state_dict())
    assert fresh.step_checks.factors == chosen
