"""The quadratic proposal of the exact head's sampled classes (spherical/kernel_proposal.py):
q(c | h) proportional to alpha (h.w_c)^2 + 1, drawn per row through a sum-tree over
the factored head's rows [v_c, 1] (query [U h, h.omega]) and over the naive head's rows w_c
(query h). In float64: the factored step equals the naive step on the same draws over several
steps (head_pairs.hard_batch: K > 1 targets, padding, repeated classes, accidental hits), with repairs and folds; the
tree equals one rebuilt from scratch; q equals the law computed over all D classes; the draws
come from the seed and resume exactly; bad settings are refused in one line."""
import pytest
import torch

from lst_lightning.heads.kernel_sampler import QuadraticSampler
from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead, exact_step

from head_pairs import accumulate_both, assert_load_refused, assert_resumes_alike, hard_batch, make_pair, run_hard

d = 6


def pair(D=120, num=6, alpha=4.0, leaf_size=None, bias=True, lr=0.2, **kw):
    neg = dict(num=num, sampler="quadratic", shared=False, seed=11, alpha=alpha, leaf_size=leaf_size)
    return make_pair("sampled", D=D, d=d, lr=lr, bias=bias, negatives=neg, scale=0.5,
                     loss_kwargs=dict(mu=1.0, gram=0.0, spherical="zloss", spherical_kwargs={"a": 0.5, "b": 2.0}),
                     **kw)


def run(f, n, steps=5):
    run_hard(f, n, steps, d=d)


def query(head, H):
    """The kernel proposal's query of each row: the factored head's [U h, h.omega], the naive head's h."""
    Hx = head.augment(H)
    return Hx if isinstance(head, NaiveSphericalHead) else torch.cat([Hx @ head.U.T, (Hx @ head.omega)[:, None]], 1)


def brute_q(W: torch.Tensor, Hx: torch.Tensor, alpha: float) -> torch.Tensor:
    """The law over all D classes, (m, D): alpha (h.w_c)^2 + 1, normalised."""
    k = alpha * (Hx @ W.T) ** 2 + 1
    return k / k.sum(1, keepdim=True)


def rebuilt(head):
    """The tree a fresh proposal builds from the head's rows now."""
    own = head.negatives.kernel.sampler
    fresh = QuadraticSampler(num_classes=head.num_classes, hidden_dim=own.tree.state.shape[1],
                             alpha=own.tree.kernel.alpha, leaf_size=own.tree.leaf_size)
    fresh.sync(head._proposal_rows())
    return fresh.tree


def assert_tree_is_rebuilt_tree(head):
    tree, want = head.negatives.kernel.sampler.tree, rebuilt(head)
    torch.testing.assert_close(tree.state, want.state, rtol=0, atol=0)
    torch.testing.assert_close(tree.sums, want.sums, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("D,leaf_size", [(200, 4), (200, None), (60, None)])  # tree draws; tree; direct draws
@pytest.mark.parametrize("bias", [True, False])
def test_factored_step_equals_naive_step_on_the_same_draws(D, leaf_size, bias):
    torch.manual_seed(0)
    f, n = pair(D=D, leaf_size=leaf_size, bias=bias)
    assert f.negatives.kernel is not None
    run(f, n)
    assert int(f.steps) == int(n.steps) == 5
    assert f.negatives.kernel.synced == f._version
    assert f.negatives.kernel.builds == 1  # the factored tree followed the written rows, never rebuilt
    assert n.negatives.kernel.builds == 5  # the naive head's every step moves all of W
    assert_tree_is_rebuilt_tree(f)
    uses_tree = f.negatives.kernel.sampler.uses_tree(6)
    assert uses_tree == (D == 200)


def test_accidental_hits_repeated_negatives_and_many_negatives():
    # 40 negatives over 30 classes, targets among the 8 with the largest outputs: accidental
    # hits and repeated negatives in the draw, both counted here.
    torch.manual_seed(2)
    f, n = pair(D=30, num=40, alpha=50.0)
    H, idx = hard_batch()
    cols, _, _, slots = f.negatives.draw(f, idx, query(f, H))
    assert bool(slots.hit.any())
    assert any(row.unique().numel() < row.numel() for row in cols)
    f.negatives.generator.manual_seed(11)
    run(f, n, steps=4)


def test_q_and_the_correction_equal_the_law_over_all_classes():
    """log q of the drawn classes and of every class, and the slots' correction
    log(k q / (1 - q_T)) with q_T summed over each row's distinct targets, against the law
    computed over all D classes from the implicit W: for both heads, after some steps."""
    torch.manual_seed(3)
    f, n = pair(D=90, num=12, alpha=30.0)
    run(f, n, steps=3)
    H, idx = hard_batch()
    for head in (f, n):
        Hx, q = head.augment(H), query(head, H)
        want = brute_q(head.weight(), Hx, 30.0)
        g = head.negatives.generator.get_state()
        head.negatives.kernel.sync(head)
        neg, log_q = head.negatives.kernel.sample(q, 12, head.negatives.generator)
        torch.testing.assert_close(log_q.exp(), want.gather(1, neg), rtol=1e-10, atol=0)
        every = torch.arange(head.num_classes).expand(idx.shape[0], -1)
        torch.testing.assert_close(head.negatives.kernel.log_q(q, every).exp(), want, rtol=1e-10, atol=0)
        head.negatives.generator.set_state(g)
        cols, _, _, slots = head.negatives.draw(head, idx, q)
        assert torch.equal(cols, neg)
        first = torch.zeros_like(idx, dtype=torch.bool)
        for i, row in enumerate(idx.tolist()):
            seen = set()
            for k, c in enumerate(row):
                first[i, k] = c >= 0 and c not in seen
                seen.add(c)
        q_t = torch.where(first, want.gather(1, idx.clamp(min=0)), 0.0).sum(1, keepdim=True)
        hit = (cols[:, :, None] == idx[:, None, :]).any(2)
        kept = (~hit).sum(1, keepdim=True).clamp(min=1).double()
        torch.testing.assert_close(slots.correction, want.gather(1, cols).log() + kept.log() - torch.log1p(-q_t),
                                   rtol=1e-10, atol=1e-12)
        assert torch.equal(slots.hit, hit)


def test_repairs_and_folds_rebuild_the_tree_and_keep_the_steps_equal(monkeypatch):
    """Singular-value fixes at every step (check_every=1, a narrow band) move all of V: the
    next draw rebuilds the tree; a fold inside the step too. The steps stay the naive head's."""
    torch.manual_seed(4)
    f, n = pair(lr=0.5, stabiliser={"check_every": 1, "sv_min": 0.999, "sv_max": 1.001}, sync_every=1)
    run(f, n, steps=4)
    assert int(f.sv_fixes) + int(f.unfactorizations) > 0
    assert f.negatives.kernel.builds > 1
    f.negatives.kernel.sync(f)
    assert_tree_is_rebuilt_tree(f)
    # every step folded into V (V <- V U B; the flags read after each step, sync_every=1): each next draw rebuilds
    monkeypatch.setattr(exact_step, "device_bounds", lambda plan, state, A, sq, kappa: exact_step.Bounds(
        torch.tensor(True), A.new_tensor(1.0), A.new_tensor(0.0)))
    f, n = pair(sync_every=1)
    run(f, n, steps=3)
    assert int(f.folds) == 3 and f.negatives.kernel.builds == 3 and f.negatives.kernel.synced is None
    f.negatives.kernel.sync(f)
    assert_tree_is_rebuilt_tree(f)


def test_fused_step_device_flags_and_exact_accumulation_equal_the_naive_head():
    torch.manual_seed(5)
    f, n = pair()
    f.step = "fused"
    run(f, n, steps=3)
    f, n = pair()
    f.sync_every = 3
    run(f, n, steps=4)
    f.sync()
    assert int(f.steps) == 4 and int(f.skipped_nonfinite) == 0
    assert_tree_is_rebuilt_tree(f)
    # two micro-batches per optimizer step: one exact step on their union, the tree drawn from
    # the state before it at both micro-batches
    f, n = pair()
    accumulate_both(f, n, hard_batch)
    assert_tree_is_rebuilt_tree(f)


def test_the_draws_come_from_the_seed():
    torch.manual_seed(6)
    H, idx = hard_batch()

    def draws(seed, head_cls=FactoredSphericalHead):
        head = head_cls(120, d, loss="sampled", dtype=torch.float64,
                        negatives=dict(num=9, sampler="quadratic", shared=False, seed=seed),
                        generator=torch.Generator().manual_seed(0))
        return head.negatives.draw(head, idx, query(head, H))[0]

    a, b, c = draws(5), draws(5), draws(6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, draws(5, NaiveSphericalHead))  # one initial W from one generator: one law


def test_resume_mid_run_gives_the_same_next_draws_and_steps():
    torch.manual_seed(7)
    # the fresh head: its generator at the start, its tree of the initial W
    g = assert_resumes_alike(lambda: pair()[0], hard_batch)
    assert g.negatives.kernel.builds == 1  # rebuilt from the loaded V at the first draw, then followed


def test_bad_settings_are_refused_in_one_line_leaving_the_head_untouched():
    for settings, match in ((dict(sampler="quadratic"), "set negatives.shared=False"),
                            (dict(sampler="rff", shared=False), "RF-softmax proposal is not drawn")):
        with pytest.raises(ValueError, match=match) as err:
            FactoredSphericalHead(40, d, loss="sampled", negatives=settings)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="parallel='replicated'") as err:
        FactoredSphericalHead(40, d, loss="sampled", negatives=dict(sampler="quadratic", shared=False),
                              parallel="replicated")
    assert "\n" not in str(err.value)
    # a state saved with another alpha: refused before anything loads
    f, _ = pair()
    g, _ = pair(alpha=2.0)
    assert_load_refused(g, f.state_dict(), "negatives", g.negatives.generator)


def test_a_checkpoint_from_before_the_kernel_settings_loads():
    """A state saved before alpha and leaf_size were settings: their defaults."""
    f, _ = make_pair("sampled", D=40, d=d, negatives=dict(num=4, seed=3), loss_kwargs=dict(mu=1.0))
    sd = f.state_dict()
    extra = sd["_extra_state"]
    extra["negatives"]["settings"] = {k: v for k, v in extra["negatives"]["settings"].items()
                                      if k not in ("alpha", "leaf_size")}
    f.load_state_dict(sd)
