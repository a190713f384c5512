"""Baseline heads against plain dense references at tiny D."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lst_lightning.heads import (AdaptiveSoftmaxHead, HierarchicalSoftmaxHead, SampledSoftmaxHead,
                                 SoftmaxHead)
from lst_lightning.baselines.hsoftmax import frequency_bins

D, d, m = 23, 5, 7


def zipf_counts(n=D):
    return (1000.0 / torch.arange(1, n + 1)).round()


def make_targets(K=3, seed=1):
    """(m, K) targets with padding and classes repeated across rows and within a row."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, D, (m, K), generator=g)
    t[0, 1:] = -1
    t[2, 0] = t[1, 0]
    if K > 1:
        t[3, 1] = t[3, 0]
    t[4, :] = -1  # a row with no target at all
    return t


def dense_loss(log_probs, t, val=None):
    """-sum_k t_k log p(idx_k), mean over rows, from a full (m, D) log-probability matrix."""
    t2 = t.reshape(t.shape[0], -1)
    v = (t2 >= 0).to(log_probs.dtype) if val is None else val.reshape(t2.shape) * (t2 >= 0)
    return -(v * log_probs.gather(1, t2.clamp(min=0))).sum(1).mean()


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


# -- softmax ---------------------------------------------------------------------
@pytest.mark.parametrize("chunked,chunk_elements", [(True, 1 << 24), (True, 2 * D), (False, 1)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("K", [1, 3])
def test_softmax_matches_dense(chunked, chunk_elements, bias, K):
    """Against logits + log_softmax; chunk_elements = 2 D makes chunks of 2 rows."""
    head = SoftmaxHead(num_classes=D, hidden_dim=d, bias=bias, chunked=chunked, chunk_elements=chunk_elements)
    if bias:
        torch.nn.init.normal_(head.bias)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(K)[:, 0] if K == 1 else make_targets(K)
    params = [h, *head.parameters()]
    got = head(h, t)
    ref = dense_loss(F.log_softmax(F.linear(h, head.weight, head.bias), 1), t)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)


def test_softmax_weighted_targets_and_cosine():
    head = SoftmaxHead(num_classes=D, hidden_dim=d, cosine_scale=3.0)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(2)
    val = torch.rand(m, 2)
    got = head(h, t, val)
    logits = 3.0 * F.normalize(h, dim=1) @ F.normalize(head.weight, dim=1).T
    ref = dense_loss(F.log_softmax(logits, 1), t, val)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, h, head.weight), grads(ref, h, head.weight)):
        torch.testing.assert_close(a, b)


def test_softmax_scores_log_prob_and_rank():
    head = SoftmaxHead(num_classes=D, hidden_dim=d, bias=True)
    h = torch.randn(m, d)
    full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=4)], 1)
    torch.testing.assert_close(full, F.linear(h, head.weight, head.bias))
    t = make_targets(1)[:, 0].clamp(min=0)
    torch.testing.assert_close(head.log_prob(h, t), F.log_softmax(full, 1).gather(1, t[:, None])[:, 0])
    rank = 1 + (full > full.gather(1, t[:, None])).sum(1)
    assert torch.equal(head.target_rank(h, t), rank)  # no ties with random floats


def test_softmax_optional_impls_fail_clearly():
    for impl in ("liger", "cce"):
        try:
            head = SoftmaxHead(num_classes=D, hidden_dim=d, impl=impl)
        except ImportError as exc:
            assert "optional package" in str(exc)
            continue
        with pytest.raises(ValueError, match="CUDA"):  # installed, but this is a CPU tensor
            head(torch.randn(m, d), make_targets(1)[:, 0])
    with pytest.raises(ValueError, match="impl"):
        SoftmaxHead(num_classes=D, hidden_dim=d, impl="fast")


# -- hierarchical softmax ----------------------------------------------------------
def hsoftmax_dense_log_probs(head, h):
    """log p(y|h) for all y by looping over clusters: the obviously-correct way."""
    cl = F.log_softmax(F.linear(h, head.cluster_weight, head.cluster_bias), 1)
    out = []
    for c in range(head.num_clusters):
        lo, hi = int(head.bounds[c]), int(head.bounds[c + 1])
        b = None if head.bias is None else head.bias[lo:hi]
        out.append(cl[:, c:c + 1] + F.log_softmax(F.linear(h, head.weight[lo:hi], b), 1))
    return torch.cat(out, 1)


@pytest.mark.parametrize("binning", ["equal_size", "equal_mass", "sqrt_mass"])
@pytest.mark.parametrize("bias", [True, False])
def test_hsoftmax_matches_dense(binning, bias):
    head = HierarchicalSoftmaxHead(num_classes=D, hidden_dim=d, class_counts=zipf_counts(), binning=binning,
                                   bias=bias)
    if bias:
        torch.nn.init.normal_(head.bias)
        torch.nn.init.normal_(head.cluster_bias)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(3)
    dense = hsoftmax_dense_log_probs(head, h)
    torch.testing.assert_close(dense.exp().sum(1), torch.ones(m))  # a distribution over classes
    params = [h, *head.parameters()]
    got, ref = head(h, t), dense_loss(dense, t)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=5)], 1)
        torch.testing.assert_close(full, dense)
        lp = head.log_prob(h, t)
        torch.testing.assert_close(lp, torch.where(t >= 0, dense.gather(1, t.clamp(min=0)), torch.zeros(())))


def test_frequency_bins():
    counts = zipf_counts(100)
    size = frequency_bins(100, 10, "equal_size")
    assert torch.equal(size, torch.arange(0, 101, 10))
    for binning in ("equal_mass", "sqrt_mass"):
        b = frequency_bins(100, 10, binning, counts)
        assert b[0] == 0 and b[-1] == 100 and (b[1:] > b[:-1]).all()
    mass = lambda b: torch.stack([counts[b[i]:b[i + 1]].sum() for i in range(len(b) - 1)])  # noqa: E731
    # Equal mass spreads the total count more evenly than equal size, sqrt-mass in between.
    spread = {k: mass(frequency_bins(100, 10, k, counts)).std() for k in ("equal_size", "sqrt_mass", "equal_mass")}
    assert spread["equal_mass"] < spread["sqrt_mass"] < spread["equal_size"]
    # Even a single dominant class leaves every cluster non-empty.
    b = frequency_bins(10, 5, "equal_mass", torch.tensor([1e9] + [1.0] * 9))
    assert (b[1:] > b[:-1]).all()
    with pytest.raises(ValueError, match="class_counts"):
        frequency_bins(100, 10, "equal_mass")
    with pytest.raises(ValueError, match="binning"):
        frequency_bins(100, 10, "by_length")
    with pytest.raises(ValueError, match="num_clusters"):
        frequency_bins(100, 101)
    with pytest.raises(ValueError, match="non-negative"):
        frequency_bins(3, 2, "equal_mass", torch.tensor([1.0, -1.0, 2.0]))


# -- adaptive softmax --------------------------------------------------------------
def test_adaptive_matches_torch():
    head = AdaptiveSoftmaxHead(num_classes=D, hidden_dim=8, cutoffs=[4, 0.5], div_value=2.0)
    assert head.cutoffs == [4, 12]
    h = torch.randn(m, 8, requires_grad=True)
    t = make_targets(1)[:, 0].clamp(min=0)
    params = [h, *head.parameters()]
    got, ref = head(h, t), head.asm(h, t).loss
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=5)], 1)
        torch.testing.assert_close(full, head.asm.log_prob(h))
    # Several targets, padding and repeats: against torch's full log-probabilities.
    t3 = make_targets(3)
    got = head(h, t3)
    ref = dense_loss(head.asm.log_prob(h), t3)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cutoffs,match", [([], "non-empty"), ([5, 5], "increasing"), ([30], "increasing"),
                                           ([0.0], "fraction"), (["a"], "ints or floats"), ([0], "increasing")])
def test_adaptive_bad_cutoffs(cutoffs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdaptiveSoftmaxHead(num_classes=D, hidden_dim=8, cutoffs=cutoffs)


def test_adaptive_rejects_zero_width_tail():
    with pytest.raises(ValueError, match="width"):
        AdaptiveSoftmaxHead(num_classes=D, hidden_dim=6, cutoffs=[4, 8, 12], div_value=4.0)


# -- bad input: clear errors, no state change --------------------------------------------
HEADS = {
    "softmax": lambda: SoftmaxHead(num_classes=D, hidden_dim=d),
    "hsoftmax": lambda: HierarchicalSoftmaxHead(num_classes=D, hidden_dim=d, class_counts=zipf_counts()),
    "adaptive": lambda: AdaptiveSoftmaxHead(num_classes=D, hidden_dim=d, cutoffs=[4]),
    "sampled_rff": lambda: SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="rff", num_samples=4),
}
BAD = [
    (lambda h, t: (h[:, :-1], t, None), ValueError, "shape"),
    (lambda h, t: (h, t.float(), None), TypeError, "int64"),
    (lambda h, t: (h[:0], t[:0], None), ValueError, "empty"),
    (lambda h, t: (h, t[:, None][:, :0], None), ValueError, "K >= 1"),
    (lambda h, t: (h, t + D, None), ValueError, "class ids"),
    (lambda h, t: (h, t - 2, None), ValueError, "class ids"),
    (lambda h, t: (h, t[:-1], None), ValueError, "shape"),
    (lambda h, t: (h, t, torch.ones(m + 1)), ValueError, "target_val"),
    (lambda h, t: (h, t, torch.full((m,), float("nan"))), ValueError, "non-finite"),
    (lambda h, t: (h.masked_fill(torch.eye(m, d, dtype=torch.bool), float("nan")), t, None), ValueError, "non-finite"),
    (lambda h, t: (h.long(), t, None), TypeError, "floating"),
]


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("bad", range(len(BAD)))
def test_bad_input_is_rejected_without_side_effects(name, bad):
    head = HEADS[name]()
    head.train()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    h, t = torch.randn(m, d), torch.arange(m)  # includes class 0, so t - 2 reaches -2
    make, exc, match = BAD[bad]
    with pytest.raises(exc, match=match):
        head(*make(h, t))
    after = head.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in head.parameters())
    if name.startswith("sampled"):
        assert head._touched is None and head._synced_version is None


def test_non_finite_loss_is_detected():
    head = SoftmaxHead(num_classes=D, hidden_dim=d)
    with torch.no_grad():
        head.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite"):
        head(torch.randn(m, d), torch.randint(0, D, (m,)))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="reduction"):
        SoftmaxHead(num_classes=D, hidden_dim=d, reduction="avg")
    with pytest.raises(ValueError, match="num_classes"):
        HierarchicalSoftmaxHead(num_classes=1, hidden_dim=d)
    with pytest.raises(ValueError, match="sampler"):
        SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="zipf")
    with pytest.raises(TypeError, match="takes no argument"):
        SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="uniform", sampler_kwargs={"power": 1.0})
    with pytest.raises(ValueError, match="class_counts"):
        SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="unigram")
    with pytest.raises(ValueError, match="num_samples"):
        SampledSoftmaxHead(num_classes=D, hidden_dim=d, num_samples=0)


# -- sampled softmax -----------------------------------------------------------------
def full_softmax_loss(head, h, t, val=None):
    return dense_loss(F.log_softmax(F.linear(head._query(h), head._keys(head.weight), head.bias), 1), t, val)


@pytest.mark.parametrize("sampler", ["uniform", "log_uniform", "unigram"])
def test_sampled_two_classes_is_exact(sampler):
    """With D = 2 every kept negative is the other class and the correction makes Z' = Z exactly."""
    head = SampledSoftmaxHead(num_classes=2, hidden_dim=d, sampler=sampler, num_samples=40,
                              class_counts=torch.tensor([5.0, 2.0]), bias=True)
    torch.nn.init.normal_(head.bias)
    h = torch.randn(m, d, requires_grad=True)
    t = torch.randint(0, 2, (m,))
    for _ in range(3):
        got, ref = head(h, t), full_softmax_loss(head, h, t)
        torch.testing.assert_close(got, ref)
        for a, b in zip(grads(got, h, head.weight, head.bias), grads(ref, h, head.weight, head.bias)):
            torch.testing.assert_close(a, b)


def test_sampled_with_exact_proposal_has_exact_loss():
    """q = softmax: every corrected negative is log(Z_t / k), so the sampled loss is the full loss."""
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="exact", num_samples=16)
    h, t = torch.randn(m, d), make_targets(3)
    for _ in range(5):
        torch.testing.assert_close(head(h, t), full_softmax_loss(head, h, t))


def mean_gradient(head, h, t, draws):
    gs = []
    for _ in range(draws):
        hh = h.clone().requires_grad_(True)
        gw, gh = torch.autograd.grad(head(hh, t), (head.weight, hh))
        gs.append(torch.cat([gw.reshape(-1), gh.reshape(-1)]))
    gs = torch.stack(gs).double()
    return gs.mean(0), gs.std(0) / draws ** 0.5


def exact_gradient(head, h, t):
    hh = h.clone().requires_grad_(True)
    gw, gh = torch.autograd.grad(full_softmax_loss(head, hh, t), (head.weight, hh))
    return torch.cat([gw.reshape(-1), gh.reshape(-1)]).double()


@pytest.mark.parametrize("seed", [0, 3])
def test_sampled_gradient_unbiased_with_softmax_proposal(seed):
    """Mean of the estimated gradients over many draws = the full-softmax gradient, within
    5 standard errors on every coordinate (W and H), targets with padding and repeats.
    Seed 0 has a row whose target is likely enough that all 8 draws hit it now and then:
    without redrawing such rows the test sees 5 standard errors of bias."""
    torch.manual_seed(seed)
    Dn = 12
    head = SampledSoftmaxHead(num_classes=Dn, hidden_dim=4, sampler="exact", num_samples=8, init_std=1.0)
    h = torch.randn(5, 4)
    t = torch.tensor([[0, 3], [3, -1], [7, 7], [11, 2], [-1, -1]])
    mean, se = mean_gradient(head, h, t, draws=1500)
    exact = exact_gradient(head, h, t)
    z = (mean - exact).abs() / (se + 1e-9)
    assert z.max() < 5.0, f"largest deviation {z.max():.1f} standard errors"
    assert se.max() > 1e-4  # the estimate really is random: the test compares something


def test_sampled_gradient_bias_is_detectable_with_a_poor_proposal():
    """The same statistic flags the bias of a uniform proposal on peaked logits: the unbiasedness
    test above has power."""
    torch.manual_seed(3)
    head = SampledSoftmaxHead(num_classes=12, hidden_dim=4, sampler="uniform", num_samples=2, init_std=3.0)
    h = torch.randn(5, 4)
    t = torch.tensor([[0], [3], [7], [11], [2]])
    mean, se = mean_gradient(head, h, t, draws=1500)
    z = (mean - exact_gradient(head, h, t)).abs() / (se + 1e-9)
    assert z.max() > 10.0


def test_sampled_eval_scores_are_full_softmax():
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="uniform", bias=True)
    h, t = torch.randn(m, d), torch.randint(0, D, (m,))
    head.eval()
    t3 = make_targets(3)
    torch.testing.assert_close(head(h, t3), full_softmax_loss(head, h, t3))
    full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=6)], 1)
    torch.testing.assert_close(full, F.linear(h, head.weight, head.bias))
    torch.testing.assert_close(head.log_prob(h, t), F.log_softmax(full, 1).gather(1, t[:, None])[:, 0])


@pytest.mark.parametrize("sampler,kwargs", [("rff", {"num_features": 16, "leaf_size": 4}),
                                            ("quadratic", {"alpha": 5.0, "leaf_size": 4})])
@pytest.mark.parametrize("cosine", [None, 4.0])
def test_kernel_sampler_tree_follows_sgd(sampler, kwargs, cosine):
    """After SGD steps the tree, updated row by row, equals a tree built afresh from W."""
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler=sampler, sampler_kwargs=kwargs,
                              num_samples=3, cosine_scale=cosine, resync_every=1000)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    for step in range(4):
        h, t = torch.randn(m, d), make_targets(2, seed=step)
        opt.zero_grad()
        head(h, t).backward()
        opt.step()
    head.sync_sampler()
    assert head._steps_since_build == 4  # partial updates, no full rebuild
    fresh = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler=sampler, sampler_kwargs=kwargs,
                               cosine_scale=cosine)
    fresh.load_state_dict(head.state_dict())
    fresh.sync_sampler(full=True)
    torch.testing.assert_close(head.sampler.tree.sums, fresh.sampler.tree.sums, rtol=1e-5, atol=1e-5)
    h = torch.randn(m, d)
    torch.testing.assert_close(head.sampler.direct_probs(head._query(h)),
                               fresh.sampler.direct_probs(fresh._query(h)))


def test_kernel_sampler_full_resync_catches_momentum():
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="rff", num_samples=3, resync_every=2)
    opt = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for step in range(2):
        opt.zero_grad()
        head(torch.randn(m, d), make_targets(1, seed=step)).backward()
        opt.step()
    head.sync_sampler()  # the 2-step period is up: a full rebuild
    assert head._steps_since_build == 0
    fresh = KernelTreeOf(head)
    torch.testing.assert_close(head.sampler.tree.sums, fresh, rtol=1e-5, atol=1e-5)


def KernelTreeOf(head):  # noqa: N802
    from lst_lightning.baselines.samplers import KernelSumTree
    tree = KernelSumTree(head.sampler.tree.kernel, head.sampler.tree.leaf_size)
    tree.build(head._keys(head.weight).detach())
    return tree.sums


@pytest.mark.parametrize("name", sorted(HEADS))
def test_target_score_and_rank_agree_with_full_scores(name):
    head = HEADS[name]()
    h, t = torch.randn(m, d), torch.randint(0, D, (m,))
    with torch.no_grad():
        full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=5)], 1)
    target = head.target_score(h, t)
    torch.testing.assert_close(target, full.gather(1, t[:, None])[:, 0])
    assert torch.equal(head.target_rank(h, t, chunk_size=5), 1 + (full > target[:, None]).sum(1))
    if head.has_log_prob:
        torch.testing.assert_close(head.log_prob(h, t), torch.log_softmax(full, 1).gather(1, t[:, None])[:, 0])


@pytest.mark.parametrize("name", ["softmax", "hsoftmax", "adaptive", "sampled", "sampled_unigram", "sampled_rff",
                                  "sampled_quadratic"])
def test_head_configs_instantiate_and_train(name):
    """conf/head/<name>.yaml builds a head the way the app does, and one step runs."""
    import inspect
    from pathlib import Path

    import hydra
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[2] / "conf" / "head"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name=name)
    target = hydra.utils.get_class(cfg._target_)
    extra = {"class_counts": zipf_counts(60)} if "class_counts" in inspect.signature(target).parameters else {}
    head = hydra.utils.instantiate(cfg, num_classes=60, hidden_dim=16, **extra)
    h = torch.randn(4, 16, requires_grad=True)
    loss = head(h, torch.randint(0, 60, (4,)))
    loss.backward()
    assert torch.isfinite(loss) and h.grad.abs().sum() > 0


def test_kernel_sampler_tree_follows_accumulated_gradients():
    """Two forwards before one optimizer step: the rows of both are updated in the tree."""
    head = SampledSoftmaxHead(num_classes=D, hidden_dim=d, sampler="rff", num_samples=2, resync_every=1000)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            head(torch.randn(m, d), make_targets(1, seed=10 * step + micro)).backward()
        opt.step()
    head.sync_sampler()
    assert head._steps_since_build == 3
    torch.testing.assert_close(head.sampler.tree.sums, KernelTreeOf(head), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_softmax_optional_impls_match_torch_on_cuda(impl):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        head = SoftmaxHead(num_classes=1000, hidden_dim=64, impl=impl, device="cuda")
    except ImportError:
        pytest.skip(f"{impl} is not installed")
    ref = SoftmaxHead(num_classes=1000, hidden_dim=64, device="cuda")
    ref.load_state_dict(head.state_dict())
    h = torch.randn(64, 64, device="cuda")
    t = torch.randint(0, 1000, (64, 2), device="cuda")
    t[0, 1] = -1
    for tt in (t[:, 0], t):
        torch.testing.assert_close(head(h, tt), ref(h, tt), rtol=2e-3, atol=2e-3)
