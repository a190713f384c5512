"""Row-sparse class rows (row_sparse.py) and the heads that use them (head.sparse=true):
the sampled and hierarchical softmax with sparse gradients step exactly like their dense
forms, touch only the rows they read, and a step's work does not grow with D; with static
rows (lst_lightning.rows) the same steps under RowAdam as under SparseAdam, and the sampled
softmax's training forward compiles whole."""
import pytest
import torch
from torch._dynamo.utils import counters

from lst_lightning.baselines import HierarchicalSoftmaxHead, SampledSoftmaxHead
from lst_lightning.baselines.row_sparse import row_gather
from lst_lightning.rows import RowAdam, static_rows

from baseline_cases import D, d, m, make_targets, zipf_counts

SAMPLERS = ["log_uniform", "unigram", "rff", "quadratic"]


def test_row_gather_gradient_is_the_dense_one_without_padding():
    ids = make_targets(3)
    real = ids >= 0
    for t in (torch.randn(D, d, requires_grad=True), torch.randn(D, requires_grad=True)):
        w = torch.randn(*ids.shape, *t.shape[1:])
        (row_gather(t, ids, True) * w).sum().backward()
        sparse, t.grad = t.grad, None
        mask = real.reshape(*real.shape, *([1] * (t.dim() - 1)))
        (t[ids.clamp(min=0)] * w * mask).sum().backward()  # padding: no gradient
        assert sparse.is_sparse
        torch.testing.assert_close(sparse.to_dense(), t.grad, rtol=0, atol=1e-6)
        # padding reads row 0, but the gradient names only the real ids
        assert set(sparse.coalesce().indices()[0].tolist()) == set(ids[real].tolist())
        with torch.no_grad():
            assert torch.equal(row_gather(t, ids, True), t[ids.clamp(min=0)])


def make_pair(kind, sampler="log_uniform", n=D, bias=True, seed=0):
    """The dense and the row-sparse form of one head, with the same parameters."""
    def build(sparse):
        torch.manual_seed(seed)
        if kind == "hsoftmax":
            return HierarchicalSoftmaxHead(num_classes=n, hidden_dim=d, class_counts=zipf_counts(n), bias=bias,
                                           sparse=sparse)
        kw = {"sampler_kwargs": {"num_features": 32}} if sampler == "rff" else {}
        cos = 4.0 if sampler == "rff" else None
        return SampledSoftmaxHead(num_classes=n, hidden_dim=d, num_samples=6, sampler=sampler, bias=bias and cos is None,
                                  cosine_scale=cos, class_counts=zipf_counts(n), sparse=sparse, **kw)
    dense, sparse = build(False), build(True)
    if dense.bias is not None:
        torch.nn.init.normal_(dense.bias)
    sparse.load_state_dict(dense.state_dict())
    return dense, sparse


CASES = [("hsoftmax", None, True), ("hsoftmax", None, False)] + [("sampled", s, True) for s in SAMPLERS]


def loss_of(head, h, t, seed=5):
    torch.manual_seed(seed)  # the same negatives for both forms
    return head(h, t)


@pytest.mark.parametrize("kind,sampler,bias", CASES)
@pytest.mark.parametrize("K", [1, 3])
def test_sparse_step_equals_dense_step(kind, sampler, bias, K):
    """One SGD step of each form on fresh inputs (padding, repeated classes): the same
    loss, the same gradient of h, the same new parameters."""
    dense, sparse = make_pair(kind, sampler, bias=bias)
    h = torch.randn(m, d)
    t = make_targets(K, seed=K + 7) if K > 1 else make_targets(3, seed=8)[:, 0]
    hd, hs = h.clone().requires_grad_(), h.clone().requires_grad_()
    ld, ls = loss_of(dense, hd, t), loss_of(sparse, hs, t)
    ld.backward()
    ls.backward()
    torch.testing.assert_close(ls, ld, rtol=0, atol=1e-6)
    torch.testing.assert_close(hs.grad, hd.grad, rtol=0, atol=1e-6)
    assert all(p.grad.is_sparse for p in sparse.sparse_parameters())
    assert len(sparse.sparse_parameters()) == 1 + (sparse.bias is not None)
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    torch.optim.SGD(sparse.parameters(), lr=0.5).step()
    for (name, a), b in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)


def record_draws(head) -> list:
    """The negatives every draw of a sampled head's sampler returns, as it returns them."""
    drawn = []
    if isinstance(head, SampledSoftmaxHead):
        sample = head.sampler.sample

        def recorded(*args, **kwargs):
            ids, log_q = sample(*args, **kwargs)
            drawn.append(ids)
            return ids, log_q
        head.sampler.sample = recorded
    return drawn


def touched_rows(head, t, neg=None):
    """The rows a step may read: the targets (sampled: and negatives), or their clusters' members."""
    real = t[t >= 0]
    if isinstance(head, HierarchicalSoftmaxHead):
        clusters = head.cluster_of[real].unique()
        return torch.cat([torch.arange(int(head.bounds[c]), int(head.bounds[c + 1])) for c in clusters])
    return torch.cat([real, neg.reshape(-1)]).unique()


@pytest.mark.parametrize("kind,sampler,bias", CASES)
def test_adam_moves_only_the_rows_a_step_read(kind, sampler, bias):
    """SparseAdam on the row-sparse gradient: every other row bit-identical (400 classes,
    targets among the first 23: most rows and clusters untouched)."""
    _, head = make_pair(kind, sampler, n=400, bias=bias)
    head.train()
    t = make_targets(3, seed=2)
    before = [p.detach().clone() for p in head.sparse_parameters()]
    opt = torch.optim.SparseAdam(head.sparse_parameters(), lr=0.1)
    drawn = record_draws(head)
    loss_of(head, torch.randn(m, d), t).backward()
    rows = touched_rows(head, t, torch.cat([ids.reshape(-1) for ids in drawn]) if drawn else None)
    opt.step()
    for p, p0 in zip(head.sparse_parameters(), before):
        assert set(p.grad.coalesce().indices()[0].tolist()) <= set(rows.tolist())
        untouched = torch.ones(p.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert untouched.any()
        assert torch.equal(p[untouched], p0[untouched])
        assert not torch.equal(p[~untouched], p0[~untouched])


@pytest.mark.parametrize("kind", ["hsoftmax", "sampled"])
def test_a_step_holds_no_dense_class_table(kind):
    """The work of a step is bounded by the rows it reads, whatever D: at D = 200 000 the
    gradient holds at most m K + S rows (sampled) or the targets' clusters' rows
    (hsoftmax, about 2 sqrt(D) each), never D."""
    n, K = 200_000, 2
    counts = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)  # Zipf: clusters of about 2 sqrt(n) at most
    head = (HierarchicalSoftmaxHead(num_classes=n, hidden_dim=d, class_counts=counts, bias=True, sparse=True)
            if kind == "hsoftmax" else SampledSoftmaxHead(num_classes=n, hidden_dim=d, num_samples=16, bias=True,
                                                          sparse=True))
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, n, (m, K), generator=g)
    loss_of(head, torch.randn(m, d), t).backward()
    bound = (m * K + 16 if kind == "sampled"
             else m * K * int((head.bounds[1:] - head.bounds[:-1]).max()))
    for p in head.sparse_parameters():
        assert p.grad.is_sparse and p.grad._nnz() <= bound < n // 10
    if kind == "hsoftmax":  # the small cluster layer is the only dense gradient
        assert head.cluster_weight.grad.shape[0] == head.num_clusters


@pytest.mark.parametrize("kind", ["hsoftmax", "sampled"])
def test_evaluation_is_the_same_in_both_forms(kind):
    dense, sparse = make_pair(kind)
    dense.eval()
    sparse.eval()
    h, t = torch.randn(m, d), make_targets(3)
    assert torch.equal(sparse(h, t), dense(h, t))
    assert torch.equal(sparse.log_prob(h, t), dense.log_prob(h, t))
    assert torch.equal(sparse.scores(h), dense.scores(h))


@pytest.mark.parametrize("cls", [HierarchicalSoftmaxHead, SampledSoftmaxHead])
def test_sparse_must_be_a_bool(cls):
    with pytest.raises(ValueError, match="sparse must be true or false"):
        cls(num_classes=D, hidden_dim=d, class_counts=zipf_counts(), sparse="yes")


@pytest.mark.parametrize("kind,sampler,bias", [c for c in CASES if c[0] == "hsoftmax" or c[1] == "log_uniform"])
@pytest.mark.parametrize("K", [1, 3])
def test_static_rows_under_row_adam_step_like_sparse_adam(kind, sampler, bias, K):
    """The row-sparse head (COO gradients, SparseAdam) and the same head with static rows
    (RowAdam), three steps on fresh targets with padding and repeated classes: the same losses
    and parameters."""
    _, coo = make_pair(kind, sampler, bias=bias)
    _, rows = make_pair(kind, sampler, bias=bias)
    static_rows(rows, rows.sparse_parameters())
    opts = [torch.optim.SparseAdam(coo.sparse_parameters(), lr=0.1), RowAdam(rows.sparse_parameters(), lr=0.1)]
    for step in range(3):
        h = torch.randn(m, d)
        t = make_targets(K, seed=step + 11) if K > 1 else make_targets(3, seed=step + 11)[:, 0]
        losses = []
        for head, opt in zip((coo, rows), opts):
            losses.append(loss_of(head, h, t, seed=step))
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    assert all(p.grad is None for p in rows.sparse_parameters())
    for (name, a), b in zip(coo.named_parameters(), rows.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)


def test_the_sampled_softmax_with_static_rows_compiles_whole_and_equals_eager():
    """torch.compile(fullgraph) of its training forward (aot_eager: the graph, not Inductor's
    code): one graph, no break, the eager loss and rows' gradients."""
    _, head = make_pair("sampled", "log_uniform", n=200)
    static_rows(head, head.sparse_parameters())
    h, t = torch.randn(m, d), make_targets(3, seed=4)
    want = loss_of(head, h, t)
    want.backward()
    rows = [p.row_grad.grad()[1].clone() for p in head.sparse_parameters()]
    for p in head.sparse_parameters():
        p.row_grad.zero_grad()
    assert head.cannot_compile() is None
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(head.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    torch.manual_seed(5)
    got = compiled(h, t)
    got.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for p, r in zip(head.sparse_parameters(), rows):
        torch.testing.assert_close(p.row_grad.grad()[1], r, rtol=0, atol=0)
    torch._dynamo.reset()


def test_what_cannot_compile_says_why():
    assert "torch sparse tensor" in make_pair("sampled", "log_uniform")[1].cannot_compile()
    assert "sum-tree" in make_pair("sampled", "quadratic")[1].cannot_compile()
    assert "only the data knows" in make_pair("hsoftmax")[1].cannot_compile()
    assert make_pair("hsoftmax")[0].cannot_compile() is None  # the dense padded form compiles
