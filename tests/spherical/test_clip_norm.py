"""``clip_norm``: the exact step's gradient of W (times P) scaled to a norm of at most the bound,
as ``torch.nn.utils.clip_grad_norm_`` would scale it, the weight decay not scaled. The factored
head equals the naive head with it (float64, both Q routes, with and without P; every mode and
the hard cases: test_random_settings.py; compiled: test_compiled.py), the step's gradient has
the bound's norm exactly where it passed it, and a bound that no gradient reaches, None or 0 is
the unclipped step bit for bit."""
import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from head_pairs import rel

D, d = 200, 6
SAMPLED = dict(loss="sampled", negatives=dict(num=9, seed=3), preconditioner={})


def pair(clip_norm, kind, wd=0.02):
    kw = dict(num_classes=D, hidden_dim=d, lr=0.7, weight_decay=wd, clip_norm=clip_norm, dtype=torch.float64, **kind)
    f = FactoredSphericalHead(**kw, generator=torch.Generator().manual_seed(0))
    n = NaiveSphericalHead(**kw)
    n.reset_weight(f.weight())
    return f, n


def batch(m, seed):
    """K = 2 targets with padding, a class repeated in a row and one shared across rows."""
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(m, d, generator=g, dtype=torch.float64) * 2
    idx = torch.randint(0, D, (m, 2), generator=g)
    idx[0, 1] = -1
    if m > 2:
        idx[1, 1], idx[2, 0] = idx[1, 0], idx[0, 0]
    return H, idx


def step(h, H, idx):
    x = H.clone().requires_grad_()
    loss = h(x, idx)
    loss.backward()
    return loss, x.grad


@pytest.mark.parametrize("kind", [dict(loss="zloss"), SAMPLED], ids=["zloss", "sampled_with_P"])
@pytest.mark.parametrize("m", [1, 5, 40], ids=["m1", "Q_by_M", "Q_by_products"])  # d + 1 = 7 rows: the Q routes
def test_the_clipped_step_equals_the_naive_heads_and_its_gradient_has_the_bounds_norm(kind, m):
    f, n = pair(0.05, kind)
    for s in range(4):
        H, idx = batch(m, s)
        W0 = f.weight().clone()
        for a, b in zip(step(f, H, idx), step(n, H, idx)):
            assert rel(a, b) < 1e-10
        assert rel(f.weight(), n.weight()) < 1e-10
        # W <- (1 - lr wd) W - lr g: the scaled gradient g has the bound's norm
        g = ((1 - 0.7 * 0.02) * W0 - f.weight()) / 0.7
        assert abs(torch.linalg.matrix_norm(g).item() - 0.05) < 1e-10


@pytest.mark.parametrize("kind", [dict(loss="zloss"), SAMPLED], ids=["zloss", "sampled_with_P"])
def test_a_bound_no_gradient_reaches_none_or_0_is_the_unclipped_step_bit_for_bit(kind):
    heads = [pair(c, kind)[0] for c in (None, 0, 1e30)]
    assert heads[1].clip_norm is None and heads[1].plan.clip_norm is None
    for s in range(3):
        H, idx = batch(5, s)
        out = [step(h, H, idx) for h in heads]
        for o in out[1:]:
            assert all(torch.equal(a, b) for a, b in zip(o, out[0]))
    assert all(torch.equal(h.weight(), heads[0].weight()) for h in heads[1:])


def test_a_bound_set_on_a_live_head_takes_the_next_step():
    f, n = pair(None, SAMPLED)
    step(f, *batch(5, 0)), step(n, *batch(5, 0))
    f.clip_norm = n.clip_norm = 0.05
    assert f.plan.clip_norm == 0.05
    H, idx = batch(5, 1)
    W0 = f.weight().clone()
    step(f, H, idx), step(n, H, idx)
    assert rel(f.weight(), n.weight()) < 1e-10
    assert abs(torch.linalg.matrix_norm(((1 - 0.7 * 0.02) * W0 - f.weight()) / 0.7).item() - 0.05) < 1e-10


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "x", True])
@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_a_bad_bound_is_refused_in_one_line_and_changes_nothing(cls, bad):
    with pytest.raises(ValueError, match="clip_norm must be finite and positive, or None or 0") as e:
        cls(D, d, loss="zloss", clip_norm=bad)
    assert "\n" not in str(e.value)
    h = cls(D, d, loss="zloss", clip_norm=0.5)
    plan = h.plan
    with pytest.raises(ValueError, match="clip_norm"):
        h.clip_norm = bad
    assert h.clip_norm == 0.5 and h.plan is plan


@pytest.mark.parametrize("kind", [{}, SAMPLED], ids=["zloss", "sampled"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_void_step_with_a_bound_leaves_the_head_untouched_under_masked_writes(kind, bad):
    """A non-finite H makes the gradient's norm, hence the bound's factor of lr, non-finite; the
    masked write adds nothing to V's rows for it: the head untouched,
    the step skipped, dL/dH zeros."""
    f = FactoredSphericalHead(D, d, lr=0.7, clip_norm=1.0, dtype=torch.float64, sync_every=4,
                              generator=torch.Generator().manual_seed(0), **kind)
    H, idx = batch(5, 0)
    H[1, 2] = float(bad)
    before = {k: v.clone() for k, v in f.state_dict().items() if isinstance(v, torch.Tensor)}
    _, dH = f.train_step(H, idx)
    assert torch.equal(dH, torch.zeros_like(dH)) and int(f.skipped_nonfinite) == 1
    for k, v in f.state_dict().items():
        if isinstance(v, torch.Tensor) and k != "skipped_nonfinite":
            assert torch.equal(v, before[k]), k
