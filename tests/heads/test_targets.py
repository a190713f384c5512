"""Input checks shared by the baseline heads (heads/targets.py): a clear error and no
change of state for every kind of bad input, in training and in ``log_prob``; non-finite
losses detected."""
import pytest
import torch

from lst_lightning.baselines import HierarchicalSoftmaxHead, SampledSoftmaxHead, SoftmaxHead

from baseline_cases import HEADS, D, d, m, make_targets

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


@pytest.mark.parametrize("name", sorted(HEADS))
def test_log_prob_refuses_the_targets_forward_refuses(name):
    """``log_prob`` (perplexity) checks its targets as the training loss does: an id outside [0, D)
    other than -1 or -100 (-2 was taken as padding, D raised torch's IndexError), a wrong shape."""
    head = HEADS[name]()
    head.eval()
    h, t = torch.randn(m, d), torch.arange(m)
    for bad, match in ((t + D, "outside"), (t - 2, "target index -2 is outside"), (t[:-1], "shape")):
        with pytest.raises(ValueError, match=match):
            head.log_prob(h, bad)
    lp = head.log_prob(h, torch.stack([t, torch.full_like(t, -100), torch.full_like(t, -1)], 1))
    assert (lp[:, 1:] == 0).all()
    torch.testing.assert_close(lp[:, 0], head.log_prob(h, t))


@pytest.mark.parametrize("name", sorted(HEADS))
def test_evaluation_refuses_hidden_states_of_the_wrong_shape_or_dtype(name):
    """``scores``, ``topk`` and ``target_rank`` name the bad hidden states (torch's matmul or index
    errors did), and leave a non-finite one to the scores (no host read chunk by chunk)."""
    head = HEADS[name]()
    head.eval()
    h = torch.randn(m, d)
    for bad, exc, match in ((h[:, :-1], ValueError, rf"hidden must have shape \(m, {d}\), got \({m}, {d - 1}\)"),
                            (h[0], ValueError, "hidden must have shape"), (h.long(), TypeError, "floating-point")):
        for call in (lambda x: head.scores(x), lambda x: head.topk(x, 2), lambda x: head.target_rank(x, torch.arange(m))):
            with pytest.raises(exc, match=match):
                call(bad)
    assert torch.isnan(head.scores(torch.full((m, d), float("nan")))).any()


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


@pytest.mark.parametrize("name", sorted(HEADS) + ["sampled_preconditioned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_hidden_states_of_another_dtype_are_taken_in_the_heads_dtype(name, dtype):
    """A float32 head on a bf16 or float64 body, no autocast, computes as on the hidden states cast to
    float32 (as the factored head does): the training loss and dL/dH (in the hidden states' dtype),
    the evaluation loss, ``log_prob``, ``scores`` and the ranks (torch's matmuls refused the mixed
    dtypes, or ran in bf16)."""
    make = HEADS.get(name, lambda: SampledSoftmaxHead(num_classes=D, hidden_dim=d, num_samples=4, preconditioner={}))
    h, t = torch.randn(m, d).to(dtype), make_targets()
    outs = []
    for x in (h, h.float()):
        torch.manual_seed(0)
        head = make()
        x = x.clone().requires_grad_(True)
        loss = head(x, t)
        loss.backward()
        head.eval()
        outs.append((loss, x.grad.to(dtype), head(x.detach(), t), head.log_prob(x.detach(), t),
                     head.scores(x.detach()), head.target_rank(x.detach(), t[:, 0].clamp(min=0))))
        assert x.grad.dtype == x.dtype and loss.dtype == torch.float32
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
