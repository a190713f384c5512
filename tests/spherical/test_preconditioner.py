"""The right preconditioner of the update (heads/preconditioner.py): the factored
step W <- c W - lr dO^T H P equals the naive head's step with dW P, in float64, over several
steps (loss, dL/dH and the implicit W after each), for every loss, sampled classes shared and
per row, every route to H U_new^-1 and to Q, a fold, device flags and exact accumulation;
the moments are the head's state: resumed exactly, untouched by a skipped step."""
import warnings

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead, exact_step, plan
from lst_lightning.heads.preconditioner import Preconditioner

import head_pairs
from head_pairs import (accumulate_both, assert_resumes_alike, assert_untouched, make_pair, rel, state_of,
                        step_both)

D, d = 40, 6
PRE = {"beta": 0.9, "damping": 0.05}  # fast-moving moments and little damping: P far from I


def pair(loss="zloss", pre=PRE, shared=True, **kw):
    if loss == "sampled":
        kw.setdefault("negatives", dict(num=6, shared=shared, seed=11))
    return make_pair(loss, D=D, d=d, lr=kw.pop("lr", 0.2), preconditioner=pre, **kw)


def hard_batch(**kw):
    # correlated, unevenly scaled inputs: their second moment is far from a multiple of I
    H, idx = head_pairs.hard_batch(d=d, **kw)
    return H @ torch.linspace(0.2, 3.0, d, dtype=H.dtype).diag() @ (torch.eye(d, dtype=H.dtype) + 0.5), idx


def run(f, n, steps=5, m=7, tol=1e-10):
    for _ in range(steps):
        errs = step_both(f, n, *hard_batch(m=m))
        assert max(errs) < tol, errs


def test_p_is_not_the_identity_and_the_moments_move():
    # (else every test below would pass with the preconditioner ignored)
    torch.manual_seed(0)
    f, n = pair(bias=True)
    run(f, n, steps=2)
    H = hard_batch()[0]
    moments = f.preconditioner.update_moments(f.input_moment, f.input_moment_weight, torch.cat([H, torch.ones(len(H), 1)], 1))
    assert rel(moments.P, torch.eye(d + 1, dtype=torch.float64)) > 0.5
    assert torch.equal(f.input_moment, n.input_moment) and float(f.input_moment_weight) == pytest.approx(0.19)
    plain, ref = pair(pre=None, bias=True)
    torch.manual_seed(0)
    plain.reset_weight(f.weight()), ref.reset_weight(f.weight())
    H, idx = hard_batch()
    step_both(f, n, H, idx), step_both(plain, ref, H, idx)
    assert rel(f.weight(), plain.weight()) > 1e-3


@pytest.mark.parametrize("loss", ["zloss", "mse", "spherical_softmax", "taylor_softmax", "sampled"])
@pytest.mark.parametrize("bias", [False, True])
def test_factored_step_equals_naive_step(loss, bias):
    torch.manual_seed(1)
    f, n = pair(loss, bias=bias, lr=0.05 if loss != "zloss" else 0.2)
    run(f, n)
    assert int(f.steps) == int(n.steps) == 5


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("route", ["m_matrix", "factors"])
def test_both_routes_of_q(route, shared, monkeypatch):
    monkeypatch.setattr(plan, "m_matrix_rows", lambda d: 10**9 if route == "m_matrix" else -1)
    torch.manual_seed(2)
    f, n = pair("sampled", shared=shared)
    run(f, n, steps=4, m=13)


@pytest.mark.parametrize("inverse", ["woodbury", "solve", "products"])
def test_every_inverse_route_and_weight_decay(inverse):
    torch.manual_seed(3)
    f, n = pair(stabiliser={"inverse": inverse}, weight_decay=0.01)
    run(f, n, steps=6, m=5 if inverse == "woodbury" else 9)


def test_a_fold_equals_the_naive_step(monkeypatch):
    # every step folded into V (V <- V U B, U = I): the rows scattered with H P
    monkeypatch.setattr(exact_step, "device_bounds", lambda plan, state, A, sq, kappa: exact_step.Bounds(
        torch.tensor(True), A.new_tensor(1.0), A.new_tensor(0.0)))
    torch.manual_seed(4)
    f, n = pair(sync_every=1)
    run(f, n, steps=3)
    assert int(f.folds) == 3


def test_device_flags_fused_step_and_exact_accumulation_equal_the_naive_head():
    torch.manual_seed(5)
    for shared in (True, False):
        f, n = pair("sampled", shared=shared)
        f.sync_every = 3
        run(f, n, steps=4)
        f.sync()
        assert int(f.steps) == 4 and int(f.skipped_nonfinite) == 0
    f, n = pair()
    f.step = "fused"
    run(f, n, steps=3)
    f, n = pair("sampled")
    accumulate_both(f, n, hard_batch)  # the moments of the micro-batches' union, once a step


def test_resume_mid_run_gives_the_same_next_steps():
    torch.manual_seed(6)
    assert_resumes_alike(lambda: pair()[0], hard_batch)


def test_a_state_saved_with_another_preconditioner_is_refused_untouched():
    torch.manual_seed(7)
    for other in (None, {"beta": 0.5, "damping": 0.05}):
        f, _ = pair()
        g, _ = pair(pre=other)
        H, idx = hard_batch()
        g(H.requires_grad_(), idx).backward()
        before = state_of(g)
        with pytest.raises(ValueError, match="preconditioner"):
            g.load_state_dict(f.state_dict())
        assert_untouched(g, before)


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_a_skipped_step_leaves_the_moments_untouched(cls):
    head = cls(D, d, loss="zloss", preconditioner=PRE, dtype=torch.float64)
    H, idx = hard_batch()
    head(H.clone().requires_grad_(), idx).backward()
    before = [head.input_moment.clone(), head.input_moment_weight.clone(), head.weight()]
    H[2, 1] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        head(H.clone().requires_grad_(), idx).backward()
        head.sync()  # the factored head's device flags are read here
    assert torch.equal(head.input_moment, before[0]) and torch.equal(head.input_moment_weight, before[1])
    assert torch.equal(head.weight(), before[2]) and int(head.skipped_nonfinite) == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: damping * tau kept a normal number
def test_white_inputs_give_the_identity_and_zero_inputs_a_finite_p(dtype):
    pre = Preconditioner(beta=0.0, damping=0.1)
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    Hx = torch.eye(4, dtype=dtype) * 2.0  # H^T H / m = I
    mom = pre.update_moments(zeros(4, 4), zeros(()), Hx)
    assert torch.allclose(mom.P, torch.eye(4, dtype=dtype)) and bool(mom.ok)
    mom = pre.update_moments(zeros(4, 4), zeros(()), Hx * 0)
    assert bool(mom.ok) and torch.allclose(mom.P, torch.eye(4, dtype=dtype) * pre.max_eig)
    # a first batch without a row with a target: the moments stay as they were, P finite
    pre = Preconditioner(beta=0.9)
    none = torch.zeros(4, dtype=torch.bool)
    mom = pre.update_moments(zeros(4, 4), zeros(()), Hx, none)
    assert bool(mom.ok) and torch.isfinite(mom.P).all() and float(mom.weight) == 0 and not mom.moment.any()


def test_a_first_batch_of_padding_alone_is_a_step_in_float32_not_a_skip():
    """Every target -100 in the first batch (a Hugging Face batch of prompt tokens only): the
    step is taken (nothing to learn from), not skipped as non-finite, and the next one learns."""
    head = FactoredSphericalHead(D, d, loss="zloss", preconditioner=PRE, dtype=torch.float32)
    H, idx = hard_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipped" warning
        head(H.float().requires_grad_(), torch.full_like(idx, -100)).backward()
        head.sync()
    assert int(head.steps) == 1 and int(head.skipped_nonfinite) == 0 and float(head.input_moment_weight) == 0
    head(H.float().requires_grad_(), idx).backward()
    head.sync()
    assert int(head.steps) == 2 and float(head.input_moment_weight) > 0


@pytest.mark.parametrize("value,match", [
    ({"beta": 1.0}, "beta must be a number in"), ({"beta": -0.1}, "beta"), ({"damping": 0.0}, "damping"),
    ({"damping": float("inf")}, "damping"), ({"beta": True}, "beta"), ({"lr": 1}, "unknown preconditioner"),
    ("kfac", "must be a Preconditioner, a dict or None"),
])
def test_bad_settings_are_refused_in_one_line(value, match):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        FactoredSphericalHead(D, d, preconditioner=value)
    assert "\n" not in str(err.value)


def test_bf16_autocast_leaves_the_step_in_the_heads_own_precision():
    torch.manual_seed(9)
    f, g = pair("sampled")[0], pair("sampled")[0]
    g.load_state_dict(f.state_dict())  # the same W, moments and generator
    for _ in range(3):
        H, idx = hard_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f(H.clone().float().requires_grad_(), idx).backward()
        g(H.clone().float().requires_grad_(), idx).backward()
    assert torch.equal(f.weight(), g.weight()) and torch.equal(f.input_moment, g.input_moment)
    assert float(f.input_moment_weight) > 0


def test_float64_moments_take_beta_in_float64():
    """The running mean's decay in the moments' own precision: beta = 0.9 is 0.9 to float64's
    rounding, not float32's (1.2e-8 off), so a float64 head holds the formula to 1e-15."""
    pre = Preconditioner(beta=0.9)
    g = torch.Generator().manual_seed(0)
    Hx = torch.randn(6, 4, generator=g, dtype=torch.float64)
    S0 = torch.eye(4, dtype=torch.float64)
    mom = pre.update_moments(S0, torch.ones((), dtype=torch.float64), Hx)
    torch.testing.assert_close(mom.moment, 0.9 * S0 + 0.1 * Hx.T @ Hx / 6, rtol=1e-15, atol=1e-15)
    assert float(mom.weight) == 0.9 * 1.0 + (1 - 0.9)
