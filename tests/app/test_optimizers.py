"""The row-sparse input side: PairedOptimizer against dense references (float64), row_adam
(static rows) against torch's SparseAdam, the rows it touches, its state across a save and
load, and sparse-aware gradient clipping."""
import copy

import pytest
import torch
from torch import nn

from lst_lightning.app.optimizers import PairedOptimizer, clip_gradients, make_optimizer
from lst_lightning.models import NgramMLP
from lst_lightning.rows import RowAdam, RowEmbedding, static_rows

V, N = 50, 3
CFG = {"name": "sgd", "lr": 0.3, "momentum": 0.0, "weight_decay": 0.0, "embedding_lr": None}


def body(sparse: bool, seed: int = 0) -> NgramMLP:
    torch.manual_seed(seed)
    return NgramMLP(V, N, embed_dim=4, hidden_sizes=[8], hidden_dim=5, sparse_embedding=sparse).double()


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    # ids from the first 20 rows only, repeated within a batch: rows 20.. are never used
    return [(torch.randint(0, 20, (6, N), generator=g), torch.randn(6, 5, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def train(model, opt, data, clip=None):
    for ctx, y in data:
        opt.zero_grad()
        ((model(ctx) - y) ** 2).sum().backward()
        if clip is not None:
            clip(list(model.parameters()))
        opt.step()
    return model


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_sparse_sgd_equals_dense_sgd(clip):
    dense, sparse = body(False), body(True)
    assert torch.equal(dense.input_embedding.weight, sparse.input_embedding.weight)
    opt_d = make_optimizer(dense, {**CFG, "embedding": "dense"})
    opt_s = make_optimizer(sparse, {**CFG, "embedding": "sparse_sgd"})
    assert isinstance(opt_s, PairedOptimizer) and not isinstance(opt_d, PairedOptimizer)
    ref_clip = {"norm": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
                "value": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01), None: None}[clip]
    our_clip = None if clip is None else (lambda ps: clip_gradients(ps, 0.05 if clip == "norm" else 0.01, clip))
    data = batches(5)
    train(dense, opt_d, data, ref_clip)
    train(sparse, opt_s, data, our_clip)
    assert sparse.input_embedding.weight.grad.is_sparse
    for (k, a), b in zip(dense.state_dict().items(), sparse.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=k)
    assert not torch.equal(dense.input_embedding.weight, body(False).input_embedding.weight)  # it moved


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_row_adam_equals_sparse_adam_with_the_apps_clipping(clip):
    """The same body and batches (repeated rows) under SparseAdam's sparse gradients and under
    static rows with RowAdam, clipped by the app's clip_gradients: the same model, float64."""
    coo, rows = body(True), body(True)
    static_rows(rows)
    assert isinstance(rows.input_embedding, RowEmbedding)
    opt_c = make_optimizer(coo, {**CFG, "name": "adam", "embedding": "sparse_adam"})
    opt_r = make_optimizer(rows, {**CFG, "name": "adam", "embedding": "row_adam"})
    assert isinstance(opt_r.parts[1], RowAdam)
    our_clip = None if clip is None else (lambda ps: clip_gradients(ps, 0.05 if clip == "norm" else 0.01, clip))
    data = batches(5)
    train(coo, opt_c, data, our_clip)
    train(rows, opt_r, data, our_clip)
    assert rows.input_embedding.weight.grad is None  # its rows' gradient lives in its RowGrad
    for (k, a), b in zip(coo.state_dict().items(), rows.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=k)
    assert not torch.equal(rows.input_embedding.weight, body(True).input_embedding.weight)  # it moved


@pytest.mark.parametrize("name", ["row_adam", "row_sgd"])
def test_the_static_row_optimisers_take_only_static_rows(name):
    with pytest.raises(ValueError, match="row_adam and row_sgd step the tables with static rows"):
        make_optimizer(body(True), {**CFG, "embedding": name})  # no static_rows: torch's sparse gradients


@pytest.mark.parametrize("name", ["sparse_adam", "adagrad", "sparse_sgd"])
def test_only_the_batch_rows_are_touched(name):
    model = body(True)
    before = model.input_embedding.weight.detach().clone()
    opt = make_optimizer(model, {**CFG, "name": "adam", "embedding": name})
    train(model, opt, batches(4))
    after = model.input_embedding.weight.detach()
    assert torch.equal(after[20:], before[20:])  # never in a batch
    assert not torch.equal(after[:20], before[:20])
    emb_state = opt.parts[1].state[model.input_embedding.weight]
    for buf in emb_state.values():  # moments / sums: zero outside the rows used
        if torch.is_tensor(buf) and buf.shape == after.shape:
            assert not buf[20:].any() and buf[:20].any()


def test_sparse_adam_is_lazy_adam():
    """SparseAdam against the obvious reference: the rows of the batch take Adam's step
    (bias correction by the parameter's step count, as torch's), the others keep their
    weights and moments."""
    model = body(True)
    w0 = model.input_embedding.weight.detach().clone()
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    opt = make_optimizer(model, {**CFG, "name": "adam", "lr": 0.5, "embedding": "sparse_adam", "embedding_lr": lr})
    assert opt.parts[1].param_groups[0]["lr"] == lr and opt.parts[0].param_groups[0]["lr"] == 0.5
    m, v, w = torch.zeros_like(w0), torch.zeros_like(w0), w0.clone()
    for t, (ctx, y) in enumerate(batches(4), start=1):
        opt.zero_grad()
        ((model(ctx) - y) ** 2).sum().backward()
        g = model.input_embedding.weight.grad.to_dense()
        opt.step()
        rows = ctx.unique()
        m[rows] = b1 * m[rows] + (1 - b1) * g[rows]
        v[rows] = b2 * v[rows] + (1 - b2) * g[rows] ** 2
        w[rows] -= lr * (1 - b2**t) ** 0.5 / (1 - b1**t) * m[rows] / (v[rows].sqrt() + eps)
    torch.testing.assert_close(model.input_embedding.weight.detach(), w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("embedding", ["sparse_adam", "row_adam"])
def test_state_dict_resumes_exactly_and_the_schedule_sets_both_parts(embedding):
    data = batches(6)
    cfg = {**CFG, "name": "adam", "embedding": embedding}

    def body(sparse: bool, seed: int = 0) -> NgramMLP:
        model = globals()["body"](sparse, seed)
        return static_rows(model) and model if embedding == "row_adam" else model

    full = body(True)
    opt = make_optimizer(full, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for batch in data:
        train(full, opt, [batch])
        sched.step()
    assert [g["lr"] for o in opt.parts for g in o.param_groups] == pytest.approx([0.3 / 7] * 2, rel=1e-12)

    part = body(True)
    opt = make_optimizer(part, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for batch in data[:3]:
        train(part, opt, [batch])
        sched.step()
    saved = copy.deepcopy((part.state_dict(), opt.state_dict(), sched.state_dict()))
    resumed = body(True, seed=5)  # different weights: all must come from the checkpoint
    resumed.load_state_dict(saved[0])
    opt = make_optimizer(resumed, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    opt.load_state_dict(saved[1])  # Lightning's order: optimisers, then schedulers
    sched.load_state_dict(saved[2])
    for batch in data[3:]:
        train(resumed, opt, [batch])
        sched.step()
    for k, a in full.state_dict().items():
        assert torch.equal(a, resumed.state_dict()[k]), k


def test_a_state_in_fsdp2s_earlier_format_is_refused_in_one_line_and_nothing_changes():
    """trainer.strategy=fsdp2 saved the row-sparse parts under 'whole' (the dense part keyed by
    the index in model.parameters()) before it saved torch's format: only fsdp2 reads that."""
    cfg = {**CFG, "name": "adam", "embedding": "sparse_adam"}
    model = body(True)
    opt = make_optimizer(model, cfg)
    train(model, opt, batches(2))
    before = copy.deepcopy(opt.state_dict())
    earlier = {"parts": [before["parts"][0], {"whole": before["parts"][1]}]}
    with pytest.raises(ValueError, match="earlier format.*trainer.strategy=fsdp2") as e:
        opt.load_state_dict(earlier)
    assert "\n" not in str(e.value)
    after = opt.state_dict()
    for part, ref in zip(after["parts"], before["parts"]):
        for k, values in ref["state"].items():
            assert all(torch.equal(a, b) if torch.is_tensor(b) else a == b
                       for a, b in zip(part["state"][k].values(), values.values()))


def test_clip_gradients_matches_torch_on_the_dense_gradients():
    torch.manual_seed(0)
    emb = nn.Parameter(torch.randn(30, 4, dtype=torch.float64))
    lin = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    idx = torch.tensor([3, 7, 3, 3, 29])  # repeated rows: an uncoalesced sparse gradient
    for algorithm, value in [("norm", 0.5), ("norm", 1e6), ("value", 0.3)]:
        g_rows = torch.randn(5, 4, dtype=torch.float64)
        emb.grad = torch.sparse_coo_tensor(idx[None], g_rows, (30, 4))
        lin.grad = torch.randn(4, 3, dtype=torch.float64)
        dense = [emb.grad.to_dense(), lin.grad.clone()]
        ref = [nn.Parameter(torch.zeros_like(d)) for d in dense]
        for r, d in zip(ref, dense):
            r.grad = d
        (torch.nn.utils.clip_grad_norm_ if algorithm == "norm" else torch.nn.utils.clip_grad_value_)(ref, value)
        clip_gradients([emb, lin], value, algorithm)
        assert emb.grad.is_sparse
        torch.testing.assert_close(emb.grad.to_dense(), ref[0].grad, rtol=1e-12, atol=0)
        torch.testing.assert_close(lin.grad, ref[1].grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("cfg,match", [
    ({"embedding": "dense"}, "optimizer.embedding=dense"),
    ({"embedding": "lazy"}, "optimizer.embedding must be"),
    ({"name": "rmsprop"}, "optimizer.name"),
    ({"embedding_lr": -1.0}, "optimizer.embedding_lr"),
    ({"head_rows": "dense"}, "optimizer.head_rows must be"),
    ({"head_rows": "adam"}, "optimizer.head_rows must be"),
])
def test_bad_settings_are_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(body(True), {**CFG, "embedding": "sparse_adam", **cfg})


def test_a_dense_body_gets_one_dense_optimizer_whatever_embedding_says():
    opt = make_optimizer(body(False), {**CFG, "name": "adam", "embedding": "sparse_adam"})
    assert type(opt) is torch.optim.Adam


def _with_head(sparse_head: bool):
    from lst_lightning.baselines import SampledSoftmaxHead  # noqa: PLC0415

    torch.manual_seed(0)
    return nn.ModuleDict({"body": body(True), "head": SampledSoftmaxHead(num_classes=V, hidden_dim=5, bias=True,
                                                                         sparse=sparse_head).double()})


@pytest.mark.parametrize("sparse_head", [True, False])
@pytest.mark.parametrize("head_lr", [None, 0.01])
def test_a_heads_rows_and_lr_get_groups_of_their_own(sparse_head, head_lr):
    """head.sparse rows join the row-sparse half at the head's lr (never embedding_lr);
    optimizer.head_lr gives the head's parameters groups of their own; the body's group comes first."""
    model = _with_head(sparse_head)
    head = model["head"]
    opt = make_optimizer(model, {**CFG, "name": "adam", "embedding": "sparse_adam", "embedding_lr": 0.07,
                                 "head_lr": head_lr}, head=head)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    own = 0.3 if head_lr is None else head_lr
    assert lr_of[id(head.weight)] == lr_of[id(head.bias)] == own
    assert lr_of[id(model["body"].input_embedding.weight)] == 0.07
    assert opt.param_groups[0]["name"] == "dense" and opt.param_groups[0]["lr"] == 0.3
    sparse_part = opt.parts[1]
    assert isinstance(sparse_part, torch.optim.SparseAdam)
    assert (id(head.weight) in {id(p) for g in sparse_part.param_groups for p in g["params"]}) == sparse_head
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_decay_warns_that_sparse_head_rows_take_none():
    model = _with_head(True)
    with pytest.warns(UserWarning, match="head.sparse=true"):
        make_optimizer(model, {**CFG, "name": "adamw", "weight_decay": 0.1, "embedding": "sparse_adam"},
                       head=model["head"])


def test_sparse_head_rows_need_a_row_sparse_optimiser():
    with pytest.raises(ValueError, match="head.sparse=true"):
        make_optimizer(_with_head(True), {**CFG, "embedding": "dense"})
    for bad in (-1.0, 0, True, "0.1"):
        with pytest.raises(ValueError, match="optimizer.head_lr must be a number > 0 or null"):
            make_optimizer(_with_head(True), {**CFG, "embedding": "sparse_adam", "head_lr": bad}, head=None)


@pytest.mark.parametrize("head_rows", ["sparse_sgd", "adagrad"])
def test_a_heads_rows_can_take_their_own_row_sparse_optimiser(head_rows):
    """optimizer.head_rows: the head's rows are stepped by that optimiser at the head's lr,
    the input embedding's by optimizer.embedding's, the rest by the dense one: the same
    model as torch's three optimisers side by side (float64, 3 steps, repeated classes);
    the schedule and a save and load reach all three parts."""
    model = _with_head(True)
    head = model["head"]
    cfg = {**CFG, "name": "adam", "embedding": "sparse_adam", "head_rows": head_rows, "head_lr": 0.05}
    opt = make_optimizer(model, cfg, head=head)
    reference = copy.deepcopy(model)
    rows = [reference["head"].weight, reference["head"].bias]
    emb = reference["body"].input_embedding.weight
    own = {"sparse_sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[head_rows]
    ref_opts = [torch.optim.Adam([p for p in reference.parameters() if all(p is not q for q in [*rows, emb])], lr=0.3),
                torch.optim.SparseAdam([emb], lr=0.3), own(rows, lr=0.05)]
    assert [type(o) for o in opt.parts] == [type(o) for o in ref_opts]
    g = torch.Generator().manual_seed(7)
    target = torch.tensor([1, 4, 4, 9, 1, 30])  # repeated classes
    for step in range(3):
        ctx = torch.randint(0, 20, (6, N), generator=g)
        for m, opts in ((model, [opt]), (reference, ref_opts)):
            torch.manual_seed(step)  # the same negatives
            m["head"](m["body"](ctx), target).backward()
            assert m["head"].weight.grad.is_sparse
            for o in opts:
                o.step()
                o.zero_grad()
    for k, a in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], a), k
    assert not torch.equal(head.weight, _with_head(True)["head"].weight)  # the rows moved
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.15, 0.15, 0.025])
    twin = copy.deepcopy(model)
    again = make_optimizer(twin, cfg, head=twin["head"])
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [len(o.state) for o in again.parts] == [len(o.state) for o in opt.parts] == [len(o.state) for o in ref_opts]
    with pytest.raises(ValueError, match="3 parts"):
        make_optimizer(model, {**cfg, "head_rows": None}, head=head).load_state_dict(opt.state_dict())
