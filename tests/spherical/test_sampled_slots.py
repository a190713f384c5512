"""Sampled classes as slots of the exact step (spherical/negatives.py, the composite
loss losses/sampled_composite.py): the factored step equals the naive head's step on the same
drawn negatives, in float64, over several steps (loss, dL/dH and the implicit W after each),
shared per batch (one dense block) and drawn per row (extra slots); the draws are the head's
own, reproducible from the seed and resumed exactly; bad settings are refused in one line."""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lst_lightning.spherical import FactoredSphericalHead, Negatives, driver, exact_step, plan
from lst_lightning.spherical.graph_step import at_zero_lr
from lst_lightning.spherical import negatives
from lst_lightning.spherical.negatives import padded_unique

import lst_kernels as lk

import head_pairs
from head_pairs import (accumulate_both, assert_load_refused, assert_resumes_alike, assert_untouched, make_pair,
                        no_host_reads, state_of, step_both)

D, d = 40, 6


def pair(shared=True, num=6, sampler="log_uniform", gram=0.0, mu=1.0, spherical="zloss", hits_removed=True, **kw):
    neg = dict(num=num, sampler=sampler, shared=shared, seed=11, remove_accidental_hits=hits_removed)
    if sampler == "unigram":
        neg["class_counts"] = torch.arange(D, 0, -1).double()
    skw = {"a": 0.5, "b": 2.0} if spherical == "zloss" else {}
    return make_pair("sampled", D=D, d=d, lr=kw.pop("lr", 0.2), negatives=neg,
                     loss_kwargs=dict(mu=mu, gram=gram, spherical=spherical, spherical_kwargs=skw), **kw)


def hard_batch(**kw):
    return head_pairs.hard_batch(d=d, **kw)


def run(f, n, steps=5, **kw):
    head_pairs.run_hard(f, n, steps, d=d, **kw)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("sampler", ["log_uniform", "uniform", "unigram"])
def test_factored_step_equals_naive_step_on_the_same_draws(shared, sampler):
    torch.manual_seed(0)
    f, n = pair(shared=shared, sampler=sampler)
    run(f, n)
    assert int(f.steps) == int(n.steps) == 5


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("spherical,mu,gram", [("zloss", 0.0, 0.0), ("zloss", 1.0, 0.3), ("mse", 0.5, 0.0),
                                               ("spherical_softmax", 1.0, 0.0), ("taylor_softmax", 0.3, 0.1)])
def test_any_spherical_term_and_the_gramian_penalty(shared, spherical, mu, gram):
    torch.manual_seed(1)
    f, n = pair(shared=shared, spherical=spherical, mu=mu, gram=gram, lr=0.05)
    run(f, n, steps=4)


@pytest.mark.parametrize("route", ["m_matrix", "factors"])
@pytest.mark.parametrize("shared", [True, False])
def test_both_routes_of_q_with_negatives(shared, route, monkeypatch):
    """Q's update through M or from d x d products (H^T Yd Yd^T H as H^T gram_rows(the other
    targets) + the block's N_Y^T N_Y, N_Y = Y_u^T H), at m = 13 > d (the rule's choice: the factors)."""
    monkeypatch.setattr(plan, "m_matrix_rows", lambda d: 10**9 if route == "m_matrix" else -1)
    torch.manual_seed(3)
    f, n = pair(shared=shared, num=20)
    run(f, n, steps=4, m=13)


@pytest.mark.parametrize("shared", [True, False])
def test_accidental_hits_and_repeated_negatives(shared):
    # 40 negatives over D = 40 log-uniform classes: repeated negatives in every draw, and
    # negatives equal to the rows' targets (accidental hits), both counted here.
    torch.manual_seed(2)
    f, n = pair(shared=shared, num=40)
    H, idx = hard_batch()
    cols, uniq, _, slots = f.negatives.draw(f, idx)
    assert bool(slots.hit.any())
    assert uniq is None or uniq.unique().numel() < cols.numel()  # (device flags: padded to S, static shapes)
    f.negatives.generator.manual_seed(11)
    errs = step_both(f, n, H, idx)
    assert max(errs) < 1e-10, errs
    run(f, n, steps=3)


@pytest.mark.parametrize("shared", [True, False])
def test_accidental_hits_kept_where_the_settings_say(shared):
    # remove_accidental_hits=False: no negative masked, the correction log(S q); the same step as
    # the naive head's, which draws by the same slots
    torch.manual_seed(2)
    f, n = pair(shared=shared, num=40, hits_removed=False)
    H, idx = hard_batch()
    cols, _, _, slots = f.negatives.draw(f, idx)
    assert not bool(slots.hit.any()) and bool((cols.expand(idx.shape[0], -1)[:, :, None] == idx[:, None, :]).any())
    f.negatives.generator.manual_seed(11)
    errs = step_both(f, n, H, idx)
    assert max(errs) < 1e-10, errs
    run(f, n, steps=3)


@pytest.mark.parametrize("inverse", ["woodbury", "solve", "products"])
def test_every_inverse_route_and_weight_decay(inverse):
    torch.manual_seed(3)
    f, n = pair(stabiliser={"inverse": inverse}, weight_decay=0.01)
    run(f, n, steps=6, m=5 if inverse == "woodbury" else 9)


@pytest.mark.parametrize("shared", [True, False])
def test_fused_step_and_exact_accumulation_equal_the_naive_head(shared):
    torch.manual_seed(4)
    f, n = pair(shared=shared)
    f.step = "fused"
    run(f, n, steps=3)
    # two micro-batches per optimizer step: one exact step on their union (negatives as slots)
    f, n = pair(shared=shared)
    accumulate_both(f, n, hard_batch)


def test_device_flags_step_equals_the_host_checked_step():
    torch.manual_seed(5)
    for shared in (True, False):
        f, n = pair(shared=shared)
        f.sync_every = 3
        run(f, n, steps=4)
        f.sync()
        assert int(f.steps) == 4 and int(f.skipped_nonfinite) == 0


def test_the_draws_are_reproducible_from_the_seed():
    idx = torch.tensor([[1, 2], [3, -1]])
    a = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=9, seed=5))
    b = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=9, seed=5))
    c = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=9, seed=6))
    da, db, dc = (h.negatives.draw(h, idx)[0] for h in (a, b, c))
    assert torch.equal(da, db) and not torch.equal(da, dc)
    # no seed: the head's own init seed (a head made from one generator draws alike)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    h1 = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=9, shared=False), generator=g1)
    h2 = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=9, shared=False), generator=g2)
    assert torch.equal(h1.negatives.draw(h1, idx)[0], h2.negatives.draw(h2, idx)[0])


@pytest.mark.parametrize("shared", [True, False])
def test_resume_mid_run_gives_the_same_next_draws_and_steps(shared):
    torch.manual_seed(6)
    assert_resumes_alike(lambda: pair(shared=shared)[0], hard_batch)  # the fresh head's generator at the start


def test_a_state_saved_with_other_negatives_is_refused_untouched():
    f, _ = pair()
    g, _ = pair(num=7)
    before = state_of(g)
    with pytest.raises(ValueError, match="negatives"):
        g.load_state_dict(f.state_dict())
    assert_untouched(g, before)


def test_a_state_saved_with_the_quadratic_proposal_is_refused_in_one_line_untouched():
    for head in pair(shared=False):
        state = head.state_dict()
        extra = state["_extra_state"]
        settings = {**extra["negatives"]["settings"], "sampler": "quadratic"}
        state["_extra_state"] = {**extra, "negatives": {**extra["negatives"], "settings": settings}}
        before = state_of(head)
        with pytest.raises(ValueError, match="negatives.sampler='quadratic': .*use a static sampler") as err:
            head.load_state_dict(state)
        assert "\n" not in str(err.value)
        assert_untouched(head, before)


def backward_forward(head, fwd):
    """The forward the update takes: ``hidden_grad``'s, its block holding the step's gradients."""
    return exact_step.hidden_grad(head.plan, driver.step_state(head), fwd, torch.ones((), dtype=head.dtype))[-1]


@pytest.mark.parametrize("inverse,m,sync_every", [("products", 7, 4), ("woodbury", 5, 1), ("solve", 7, 1)])
def test_the_step_changes_nothing_of_its_forward(monkeypatch, inverse, m, sync_every):
    # The step's contract: dL/dH (hidden_grad) and the write change nothing of their inputs. After
    # a step with shared negatives the forward's block is the object the forward made, unchanged:
    # the step's gradients G_u and N = G_u^T H (Q from d x d products, m > d) are the backward's
    # own; and the step equals the naive head's.
    made = []
    forward = driver.forward

    def spy(*a, **k):
        loss, fwd = forward(*a, **k)
        made.append((fwd, dict(vars(fwd)), dict(vars(fwd.neg)),
                     {k: v.clone() for k, v in vars(fwd.neg).items() if isinstance(v, torch.Tensor)}))
        return loss, fwd

    monkeypatch.setattr(driver, "forward", spy)
    torch.manual_seed(12)
    f, n = pair(num=30, sync_every=sync_every, stabiliser=dict(inverse=inverse))
    errs = step_both(f, n, *hard_batch(m=m))
    assert max(errs) < 1e-10, errs
    (fwd, fields, block, values), = made
    assert f.plan.negatives == "shared" and int(f.steps) == 1 and fwd.neg.G_u is None
    for now, before in ((vars(fwd), fields), (vars(fwd.neg), block)):  # the same objects
        assert now.keys() == before.keys() and all(now[k] is v for k, v in before.items())
    assert all(torch.equal(getattr(fwd.neg, k), v) for k, v in values.items())


def as_slots(block, idx, GA):
    """A shared block as S extra slots of every row: the general path's form of the same Yd."""
    m, S = idx.shape[0], block.cols.numel()
    return torch.cat([idx, block.cols.expand(m, S)], 1), torch.cat([GA, block.G_neg], 1)


@pytest.mark.parametrize("sync_every", [1, 4])  # the same device part, the flags read every step or every 4
def test_shared_block_gram_equals_the_slot_gram(sync_every):
    # Yd Yd^T of the dense block (sparse_gram of the targets off the block + Y_u Y_u^T, the
    # accidental hits joined to Y_u) equals the slot-pair form on the negatives written as
    # slots of every row (K = 3, padding, repeated classes, repeated negatives, hits).
    torch.manual_seed(7)
    f, _ = pair(num=30, sync_every=sync_every)
    H, idx = hard_batch()
    _, fwd = f._forward_step(f.augment(H), idx, torch.ones(idx.shape, dtype=torch.float64) * (idx >= 0))
    fwd = backward_forward(f, fwd)  # the block with the step's gradients
    idx_s, GA_s = as_slots(fwd.neg, fwd.idx, fwd.GA)
    want = lk.reference.sparse_gram(idx_s, GA_s)
    torch.testing.assert_close(fwd.neg.gram(f.plan, fwd.idx, fwd.GA), want, rtol=1e-12, atol=1e-12)
    # Q's route without M: H^T Yd Yd^T H as H^T gram_rows(the targets off the block) + N_Y^T N_Y,
    # N_Y = Y_u^T H; N = G_u^T H, for the write
    H = fwd.Hx
    assert (fwd.neg._hits(fwd.idx, fwd.GA)[0] >= 0).sum() >= 2  # accidental hits, their rows of N_Y scattered
    YYH, HYYH, N = fwd.neg.gram_terms(f.plan, fwd.idx, fwd.GA, H)
    torch.testing.assert_close(H.T @ YYH + HYYH, H.T @ lk.reference.gram_rows(idx_s, GA_s, H), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(N, fwd.neg.G_u.T @ H, rtol=1e-12, atol=1e-12)


class LargestAllocation(TorchDispatchMode):
    """The most elements any op's output holds in its own storage (a view counts its base's)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() // t.element_size() > self.largest:
                self.largest, self.op = t.untyped_storage().nbytes() // t.element_size(), (func, tuple(t.shape))
        return out


@pytest.mark.parametrize("sync_every", [1, 8])  # the columns coalesced on the host, or by rows (device flags)
@pytest.mark.parametrize("sampler", ["uniform", "log_uniform"])
def test_per_row_negatives_never_form_their_slot_pairs(sync_every, sampler):
    # Q's update through M (m <= d) needs the m x m Yd Yd^T of m (K + S) slots: its slot-pair
    # form, (m (K + S))^2 comparisons, took 13.5 GB at m = 128, S = 512 under device flags. The
    # step's largest tensor stays within O(m (K + S) d), and the gram equals the slot-pair form.
    Dn, dn, m, S = 500, 32, 16, 128
    f = FactoredSphericalHead(Dn, dn, loss="sampled", negatives=dict(num=S, sampler=sampler, shared=False, seed=1),
                              sync_every=sync_every, dtype=torch.float64)
    assert m <= f.plan.m_matrix_rows  # the route through M
    y = torch.randint(0, Dn, (m,))
    f(torch.randn(m, dn, dtype=torch.float64, requires_grad=True), y).backward()  # the proposal made once
    with LargestAllocation() as big:
        f(torch.randn(m, dn, dtype=torch.float64, requires_grad=True), y).backward()
    assert int(f.steps) == 2
    pairs, bound = (m * (1 + S)) ** 2, 4 * m * (1 + S) * dn
    assert big.largest <= bound < pairs // 8, big.op
    torch.manual_seed(3)
    g, _ = pair(shared=False, num=30, sampler=sampler, sync_every=sync_every)
    H, idx = hard_batch()
    _, fwd = g._forward_step(g.augment(H), idx, torch.ones(idx.shape, dtype=torch.float64) * (idx >= 0))
    fwd = backward_forward(g, fwd)
    torch.testing.assert_close(fwd.neg.gram(g.plan, fwd.idx, fwd.GA), lk.reference.sparse_gram(fwd.idx, fwd.GA),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("settings,match", [
    (dict(num=0), "num must be a positive int"),
    (dict(num=True), "num must be a positive int"),
    (dict(sampler="rff"), "RF-softmax proposal is not drawn"),
    (dict(sampler="quadratic"), "sum-tree walk costs thousands of the default's steps"),
    (dict(sampler="quadratic", shared=False), "use a static sampler"),
    (dict(alpha=0.0), "alpha must be a finite number > 0"),
    (dict(leaf_size=0), "leaf_size must be a positive int"),
    (dict(sampler="exact"), "sampler must be one of"),
    (dict(sampler="unigram"), "needs negatives.class_counts"),
    (dict(sampler="unigram", class_counts=torch.ones(D), power="x"), "power must be a finite number"),
    (dict(sampler="unigram", class_counts=torch.ones(D + 1)), r"class_counts must have shape \(40,\)"),
    (dict(shared="yes"), "shared must be a bool"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(bogus=1), "unknown negatives setting"),
])
def test_bad_settings_are_refused_in_one_line(settings, match):
    with pytest.raises(ValueError, match=match) as err:
        FactoredSphericalHead(D, d, loss="sampled", negatives=settings)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("bad", [[[1, D]], [[1, -2]]])
def test_bad_targets_are_refused_before_the_draw(shared, bad):
    """Checks read at once: one line, and nothing moves: no buffer, and no draw from the head's
    generator (a resumed run would otherwise draw other negatives than the run never stopped).
    Device flags void the step at the next read (test_device_flags.py): its draw is spent."""
    for head in pair(shared=shared, sync_every=1):
        before, rng = state_of(head), head.negatives.generator.get_state()
        with pytest.raises(ValueError, match="outside") as err:
            head(torch.randn(1, d, dtype=torch.float64, requires_grad=True), torch.tensor(bad)).backward()
        assert "\n" not in str(err.value)
        assert_untouched(head, before)
        assert torch.equal(head.negatives.generator.get_state(), rng)


def test_loss_and_negatives_go_together_and_modes_not_taken_are_refused():
    with pytest.raises(ValueError, match="needs negatives"):
        FactoredSphericalHead(D, d, loss="sampled", negatives=None)
    assert FactoredSphericalHead(D, d, loss="sampled").negatives is not None  # "auto", the default: on
    with pytest.raises(ValueError, match="negatives need a loss with sampled classes"):
        FactoredSphericalHead(D, d, loss="zloss", negatives=dict(num=4))
    # a static sampler draws inside the graph (CudaGraphStep: on CUDA; tests/spherical/test_cuda.py)
    g = FactoredSphericalHead(D, d, loss="sampled", negatives=Negatives(num=4), sync_every=2)
    g.step = "cuda_graph"
    assert g.step == "cuda_graph"


def test_default_heads_never_enter_the_negatives_code(monkeypatch):
    import lst_lightning.spherical.negatives as negatives  # noqa: PLC0415

    def boom(*a, **k):
        raise AssertionError("entered")

    for mode in (negatives.SharedDraw, negatives.PerRowDraw):
        for name in ("loss_and_grads", "draw"):
            monkeypatch.setattr(mode, name, boom)
    monkeypatch.setattr(negatives.NegativeSampling, "draw", boom)
    f, n = make_pair("zloss", D=D, d=d)
    H, idx = hard_batch()
    step_both(f, n, H, idx)
    assert f.negatives is None and n.negatives is None


def test_softmax_of_the_outputs_is_the_model_its_held_out_perplexity_falls():
    """The softmax term makes o logits: an exported model samples from softmax(o) (export.py
    leaves them alone); its perplexity on held-out rows is finite and falls with training."""
    from lst_lightning.integrations.export import sampling_logits  # noqa: PLC0415

    torch.manual_seed(8)
    Dm, dm = 50, 8
    centers = torch.randn(Dm, dm, dtype=torch.float64)

    def data(m):
        y = torch.randint(0, Dm, (m,))
        return centers[y] + 0.3 * torch.randn(m, dm, dtype=torch.float64), y

    head = FactoredSphericalHead(Dm, dm, loss="sampled", dtype=torch.float64, lr=0.5,
                                 negatives=dict(num=10, sampler="uniform", seed=1))
    Hv, yv = data(200)

    def perplexity():
        logits = sampling_logits(head.loss_fn, head.scores(Hv))
        return float(torch.nn.functional.cross_entropy(logits, yv).exp())

    before = perplexity()
    for _ in range(60):
        H, y = data(32)
        head(H.requires_grad_(), y).backward()
    after = perplexity()
    assert torch.isfinite(torch.tensor(after)) and after < 0.5 * before, (before, after)
    assert torch.equal(sampling_logits(head.loss_fn, Hv), Hv)


def test_bf16_autocast_leaves_the_step_in_the_heads_own_precision():
    torch.manual_seed(9)
    f, g = pair()[0], pair()[0]
    g.load_state_dict(f.state_dict())  # the same W and generator
    for _ in range(3):
        H, idx = hard_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            Lf = f(H.clone().float().requires_grad_(), idx)
            Lf.backward()
        g(H.clone().float().requires_grad_(), idx).backward()
    assert torch.equal(f.weight(), g.weight())


# -- drawn on the device: what a CUDA graph captures (step="cuda_graph"; graph_step.py) -------
@pytest.mark.parametrize("ids", [[5, 1, 5, 9, 1, 1, 0, 9], [3, 3, 3, 3], [7, 2, 0, 4], [8]])
def test_padded_unique_is_torch_unique_in_fixed_shapes(ids):
    ids = torch.tensor(ids)
    uniq, inv = padded_unique(ids)
    ref, ref_inv = torch.unique(ids, sorted=True, return_inverse=True)
    u = ref.numel()
    assert uniq.shape == inv.shape == ids.shape
    assert torch.equal(uniq[:u], ref) and torch.equal(inv, ref_inv)
    assert bool((uniq[u:] == ids.max()).all())  # padded with the largest: still sorted
    assert torch.equal(torch.searchsorted(uniq, ids), ref_inv)


def device_drawing_pair(shared, num):
    f, n = pair(shared=shared, num=num)
    for h in (f, n):
        h.negatives.draw_on("cpu")  # the device's own generator and the graph's static shapes
    f.sync_every = 3  # a graph's step: device flags, no host read
    return f, n


@pytest.mark.parametrize("shared", [True, False])
def test_draws_on_the_device_equal_the_naive_head(shared):
    """The step a CUDA graph captures, on the CPU: the draw from the device generator, shared
    negatives coalesced in fixed shapes (columns past the distinct ones carry zero gradients),
    40 negatives over 40 classes (repeats and accidental hits in every draw), K = 3, padding."""
    torch.manual_seed(7)
    f, n = device_drawing_pair(shared, num=40)
    host = f.negatives.generator.get_state()
    _, idx = hard_batch()
    cols, uniq, _, slots = f.negatives.draw(f, idx)
    assert bool(slots.hit.any()) and (uniq is None or uniq.numel() == cols.numel())  # padded to S
    f.negatives.device_generator.manual_seed(12)
    n.negatives.device_generator.manual_seed(12)
    run(f, n, steps=4)
    f.sync()
    assert int(f.steps) == 4 and int(f.skipped_nonfinite) == 0
    assert torch.equal(f.negatives.generator.get_state(), host)  # the host generator draws no more


def test_device_draws_resume_alike_and_a_host_drawn_state_is_refused_untouched():
    torch.manual_seed(8)
    assert_resumes_alike(lambda: device_drawing_pair(True, num=6)[0], hard_batch)
    host_drawn, _ = pair()
    f, _ = device_drawing_pair(True, num=6)
    assert_load_refused(f, host_drawn.state_dict(), "drawn on the host", f.negatives.device_generator)


def test_the_graphs_warm_up_undoes_its_draws():
    """CudaGraphStep warms up with real steps at lr 0 (at_zero_lr): they leave the head and the
    generator where they were, so the graph's first replay draws what the eager step would."""
    torch.manual_seed(9)
    f, _ = device_drawing_pair(True, num=6)
    f.step = "fused"
    before, draws = state_of(f), f.negatives.device_generator.get_state()
    with at_zero_lr(f):
        for _ in range(3):
            f.train_step(*hard_batch())
    assert_untouched(f, before)
    assert torch.equal(f.negatives.device_generator.get_state(), draws)


class NoDataDependentShapes(TorchDispatchMode):
    """Raises on an op whose output shape depends on the data (a CUDA graph cannot capture it),
    called from the negatives' code (the CPU references of lst_kernels have their own)."""

    OPS = ("aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::nonzero", "aten::masked_select")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.OPS and any(
                f.filename.endswith(("negatives.py", "sampled_composite.py", "samplers.py"))
                for f in traceback.extract_stack()):
            raise AssertionError(f"{func._schema.name}: a shape that depends on the data")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shared", [True, False])
def test_the_device_draw_reads_nothing_on_the_host_in_fixed_shapes(monkeypatch, shared):
    """What the graph captures (train_step, flags on the device) with the draw on the device:
    no host read and no data-dependent shape; a draw coalesced by ``torch.unique`` (in place of
    ``padded_unique``) is caught by the same check, so it can fail."""
    def steps(head):
        for _ in range(3):
            head.train_step(*hard_batch())
    f = FactoredSphericalHead(D, d, loss="sampled", negatives=dict(num=30, shared=shared, seed=1), sync_every=8,
                              dtype=torch.float64)
    f.negatives.draw_on("cpu")
    steps(f)  # the proposal's q made once, outside the capture (CudaGraphStep's warm-up)
    with no_host_reads(monkeypatch), NoDataDependentShapes():
        steps(f)
    if shared:
        monkeypatch.setattr(negatives, "padded_unique", lambda ids: torch.unique(ids, sorted=True, return_inverse=True))
        with NoDataDependentShapes(), pytest.raises(AssertionError, match="depends on the data"):
            steps(f)
