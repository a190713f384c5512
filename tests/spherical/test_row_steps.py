"""Row steps (spherical/row_steps.py, ``row_steps="adagrad"``): the update's sparse part scaled
per class by r_c = scale / sqrt(eps + acc_c), acc_c the class's summed ||(Yd^T H)_c||^2. The
factored step equals the naive head's step on its explicit W, in float64, over several steps
(loss, dL/dH and W after each, and the accumulators): K > 1 targets, padding, classes repeated
within and across rows, sampled classes shared (accidental hits, repeated draws) and per row, P
on and off, both routes of Q, device flags and host checks, a loss without sampled classes. The
option off leaves the head as it was (no buffer); bad settings and the modes it cannot take are
refused in one line; the accumulators are checkpointed."""
import io

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead, plan

import head_pairs
from head_pairs import assert_resumes_alike, make_pair, rel, step_both

D, d = 40, 6
ROW = dict(row_steps="adagrad", row_step_scale=0.05, row_step_eps=1e-6)  # r far from 1: 0.05 to 50
RMS = dict(row_steps="rmsprop", row_step_scale=0.05, row_step_eps=1e-6, row_step_beta=0.8)


def pair(loss="sampled", shared=True, num=6, pre=None, row=ROW, **kw):
    if loss == "sampled":
        kw.setdefault("negatives", dict(num=num, shared=shared, seed=11))
    return make_pair(loss, D=D, d=d, lr=kw.pop("lr", 0.2), preconditioner=pre, **row, **kw)


def run(f, n, steps=6, m=7, tol=1e-10):
    for _ in range(steps):
        errs = step_both(f, n, *head_pairs.hard_batch(d=d, m=m))
        assert max(errs) < tol, f"relative errors (loss, dL/dH, W) = {errs}"
    if f.row_acc is not None:
        assert rel(f.row_acc, n.row_acc) < tol


@pytest.mark.parametrize("row", [ROW, RMS], ids=["adagrad", "rmsprop"])
@pytest.mark.parametrize("sync_every", [1, None])  # host checks, device flags
@pytest.mark.parametrize("pre", [None, {"beta": 0.9, "damping": 0.05}])
@pytest.mark.parametrize("shared", [True, False])
def test_factored_step_equals_naive_step(shared, pre, sync_every, row):
    torch.manual_seed(0)
    f, n = pair(shared=shared, pre=pre, sync_every=sync_every, row=row)
    run(f, n)
    assert int(f.steps) == int(n.steps) == 6


@pytest.mark.parametrize("row", [ROW, RMS], ids=["adagrad", "rmsprop"])
@pytest.mark.parametrize("route", ["m_matrix", "factors"])
@pytest.mark.parametrize("shared", [True, False])
def test_both_routes_of_q(shared, route, row, monkeypatch):
    monkeypatch.setattr(plan, "m_matrix_rows", lambda d: 10**9 if route == "m_matrix" else -1)
    torch.manual_seed(3)
    f, n = pair(shared=shared, num=12, row=row)
    run(f, n, steps=4, m=13)


@pytest.mark.parametrize("row", [ROW, RMS], ids=["adagrad", "rmsprop"])
def test_repeated_negatives_and_accidental_hits(row):
    torch.manual_seed(2)
    f, n = pair(num=20, row=row)  # 20 log-uniform draws of 40 classes: repeats and hits of the targets (classes 0-7)
    run(f, n, steps=5)


@pytest.mark.parametrize("loss", ["zloss", "spherical_softmax"])
def test_a_loss_without_sampled_classes(loss):
    torch.manual_seed(4)
    f, n = pair(loss, lr=0.05)
    run(f, n, steps=5)


def test_the_factors_change_the_step_and_the_body_keeps_the_true_gradient():
    # (else every test above would pass with the factors ignored)
    torch.manual_seed(5)
    f, _ = pair()
    plain, _ = pair(row={})
    plain.reset_weight(f.weight())
    H, idx = head_pairs.hard_batch(d=d)
    grads = []
    for head in (f, plain):
        Hl = H.clone().requires_grad_()
        head(Hl, idx).backward()
        grads.append(Hl.grad)
    assert torch.equal(grads[0], grads[1])  # the same W before the step: the same dL/dH
    assert rel(f.weight(), plain.weight()) > 1e-2
    touched = f.row_acc[:, 1] > 0
    assert float(f.row_acc.sum()) > 0 and 0 < int(touched.sum()) < D
    assert torch.equal(f.row_acc[:, 1][touched], torch.ones(int(touched.sum()), dtype=torch.float64))


def test_off_by_default_no_buffer():
    f = FactoredSphericalHead(D, d)
    assert f.row_steps is None and f.row_acc is None and "row_acc" not in f.state_dict()
    assert f.plan.row_steps is None


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
@pytest.mark.parametrize("kw,match", [({"row_steps": "adam"}, "row_steps must be one of"),
                                      ({"row_steps": "adagrad", "row_step_scale": 0.0}, "row_step_scale"),
                                      ({"row_steps": "adagrad", "row_step_eps": float("nan")}, "row_step_eps"),
                                      ({"row_steps": "rmsprop", "row_step_beta": 1.0}, "row_step_beta")])
def test_bad_settings_are_refused_in_one_line(cls, kw, match):
    with pytest.raises(ValueError, match=match) as err:
        cls(D, d, **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("parallel", ["replicated", "sharded"])
def test_several_processes_are_refused(parallel):
    with pytest.raises(ValueError, match="row_steps='adagrad' with parallel") as err:
        FactoredSphericalHead(D, d, parallel=parallel, **ROW)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_accumulation_is_refused(cls):
    head = cls(D, d, **ROW)
    assert "row_steps='adagrad'" in head.cannot_accumulate()
    with pytest.raises(Exception, match="row_steps"):
        head.attach(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))


def test_the_accumulators_resume_and_an_old_state_loads():
    def batches():
        return head_pairs.hard_batch(d=d)

    def make():
        torch.manual_seed(6)
        return FactoredSphericalHead(D, d, dtype=torch.float64, negatives=dict(num=6, seed=11), **ROW)

    g = assert_resumes_alike(make, batches)
    assert float(g.row_acc.sum()) > 0
    old = {k: v for k, v in FactoredSphericalHead(D, d, dtype=torch.float64, negatives=dict(num=6, seed=11)
                                                  ).state_dict().items()}
    assert "row_acc" not in old
    h = make()
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    h.row_acc.fill_(3.0)
    h.load_state_dict(torch.load(buf, weights_only=False))
    assert torch.equal(h.row_acc, torch.zeros(D, 2, dtype=torch.float64))


def test_reset_weight_zeroes_the_accumulators():
    for head in pair():
        head.row_acc.fill_(1.0)
        head.reset_weight()
        assert not bool(head.row_acc.any())


@pytest.mark.slow
def test_the_compiled_step_traces_whole_and_equals_the_naive_head(monkeypatch):
    """The device step with row steps: one graph, no break; compiled (Dynamo and AOTAutograd,
    no Inductor code generation) it equals the naive head."""
    from torch._dynamo.utils import counters

    from lst_lightning.spherical import driver, exact_step
    torch._dynamo.reset()
    counters.clear()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    monkeypatch.setattr(driver, "_compiled", {})
    try:
        torch.manual_seed(7)
        f, n = pair(pre={}, sync_every=4)
        g, _ = pair(pre={}, sync_every=4)
        for h in (f, g):
            h.compile_step, h.step = True, "fused"
        assert f.compiles
        H, idx = head_pairs.hard_batch(d=d)
        Hx, idx, T = g.prepare(H, idx, None, step=True)
        draws = driver.before_step(g, H.shape[0])
        explained = torch._dynamo.explain(exact_step.device_step)(g.plan, driver.step_state(g),
                                                                  exact_step.Batch(Hx, idx, T), g.device_lr(), draws,
                                                                  exact_step.step_route(g.plan, Hx.shape[0]))
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        run(f, n, steps=4)
        f.sync()
        assert rel(f.weight(), n.weight()) < 1e-10 and rel(f.row_acc, n.row_acc) < 1e-10
    finally:
        torch._dynamo.reset()
