"""When the spherical heads step: at the optimizer's step once attached (exact gradient
accumulation, the loss scale divided out, no step when the GradScaler skips), once per
forward, and never in eval mode."""
import copy
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from lst_lightning.distributed.collectives import ProcessGroup
from lst_lightning.spherical import plan

from head_pairs import batch, deferred, make_pair, rel

SIZES, KS = (5, 3, 7), (2, 1, 3)  # micro-batches of different sizes and numbers of targets


def micro_batches(D=60, d=8):
    return [batch(m, d, D, K, classes=10) for m, K in zip(SIZES, KS)]


def union(batches):
    K = max(idx.shape[1] for _, idx in batches)
    H = torch.cat([H for H, _ in batches])
    idx = torch.cat([F.pad(idx, (0, K - idx.shape[1]), value=-1) for _, idx in batches])
    return H, idx


def dummy_optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def twins(loss, **kw):
    """A factored/naive pair and a second pair at the same W (the reference)."""
    f, n = make_pair(loss, **kw)
    ref_f, ref_n = make_pair(loss, **kw)
    ref_f.reset_weight(f.weight())
    ref_n.reset_weight(n.weight())
    return (f, ref_f), (n, ref_n)


@pytest.mark.parametrize("route", ["m_matrix", "factors"])
@pytest.mark.parametrize("loss", ["zloss", "mse", "spherical_softmax", "taylor_softmax"])
@pytest.mark.parametrize("bias", [False, True])
def test_accumulated_micro_batches_equal_one_step_on_their_union(loss, bias, route, monkeypatch):
    monkeypatch.setattr(plan, "m_matrix_rows", lambda d: 10**9 if route == "m_matrix" else -1)  # both routes of Q
    pairs = twins(loss, bias=bias, lr=0.2, weight_decay=0.01)
    batches = micro_batches()
    M = sum(SIZES)
    Hu, idxu = union(batches)
    for head, ref in pairs:
        Hr = Hu.clone().requires_grad_()
        ref(Hr, idxu).backward()
        opt = dummy_optimizer()
        head.attach(opt)
        dHs = []
        for H, idx in batches:  # weights m_i / M: the union's mean over its rows
            Hc = H.clone().requires_grad_()
            (head(Hc, idx) * (H.shape[0] / M)).backward()
            dHs.append(Hc.grad)
        assert int(head.steps) == 0 and head.pending_rows == M
        assert rel(torch.cat(dHs), Hr.grad) < 1e-12  # W has not changed between micro-batches
        opt.step()
        assert int(head.steps) == 1 and head.pending_rows == 0
        assert rel(head.weight(), ref.weight()) < 1e-12
        opt.step()  # nothing kept: no step
        assert int(head.steps) == 1
    assert rel(pairs[0][0].weight(), pairs[1][0].weight()) < 1e-10  # factored == naive


def test_a_state_loaded_between_two_optimizer_steps_drops_the_kept_rows_with_a_warning():
    """The rows kept for the next optimizer step were made against the state before the load: a
    load drops them, warning how many (as a copy does), and the step after is the loaded state's."""
    (H1, i1), (H2, i2), _ = micro_batches()
    for head, ref in twins("zloss", lr=0.2):
        saved = copy.deepcopy(head.state_dict())
        opt = dummy_optimizer()
        head.attach(opt)
        head(H1.clone().requires_grad_(), i1).backward()
        assert head.pending_rows == H1.shape[0]
        with pytest.warns(UserWarning, match=f"drops the {H1.shape[0]} rows kept"):
            head.load_state_dict(saved)
        assert head.pending_rows == 0
        head(H2.clone().requires_grad_(), i2).backward()
        opt.step()
        ref.load_state_dict(saved)
        ref(H2.clone().requires_grad_(), i2).backward()
        assert int(head.steps) == 1 and torch.equal(head.weight(), ref.weight())


def test_attached_forwards_may_precede_their_backwards():
    """Two forwards, then one backward of their sum == forward, backward, forward, backward."""
    pairs = twins("zloss", lr=0.2)
    (H1, i1), (H2, i2), _ = micro_batches()
    for head, ref in pairs:
        for h, together in ((head, True), (ref, False)):
            opt = dummy_optimizer()
            h.attach(opt)
            if together:
                (h(H1, i1) + h(H2, i2)).backward()
            else:
                h(H1, i1).backward()
                h(H2, i2).backward()
            opt.step()
        assert int(head.steps) == 1 and rel(head.weight(), ref.weight()) < 1e-13
    assert rel(pairs[0][0].weight(), pairs[1][0].weight()) < 1e-10


def test_too_many_kept_rows_are_refused_before_any_change():
    f, _ = make_pair("zloss")
    opt = dummy_optimizer()  # the head holds its optimizer weakly: a loop holds it
    f.attach(opt, max_pending_rows=6)
    (H1, i1), (H2, i2), _ = micro_batches()
    f(H1, i1).backward()
    W0 = f.weight()
    with pytest.raises(ValueError, match="max_pending_rows=6"):
        f(H2, i2)
    assert f.pending_rows == 5 and torch.equal(f.weight(), W0)


@pytest.mark.parametrize("bad", [True, 0, 2.5])
def test_a_bad_bound_on_kept_rows_is_refused_and_the_old_one_kept(bad):
    f, _ = make_pair("zloss")
    before = f.max_pending_rows
    with pytest.raises(ValueError, match="max_pending_rows must be a positive int"):
        f.max_pending_rows = bad
    with pytest.raises(ValueError, match="max_pending_rows must be a positive int"):
        f.attach(dummy_optimizer(), max_pending_rows=bad)
    assert f.max_pending_rows == before and not f.attached


def test_attach_refuses_heads_that_step_in_their_forward():
    f = deferred(sync_every=1, step="fused")
    with pytest.raises(ValueError, match="step='fused'"):
        f.attach(dummy_optimizer())
    f = deferred(sync_every=4)  # device flags wait for the optimizer's step as host checks do
    f.attach(dummy_optimizer())
    with pytest.raises(TypeError, match="Optimizer"):
        f.attach(object())


class Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper as accelerate's ``AcceleratedOptimizer`` is: an Optimizer that never
    ran ``Optimizer.__init__`` (no step hooks of its own), stepping ``.optimizer`` on the steps it
    takes, with the loop's ``.scaler``."""

    def __init__(self, optimizer, scaler=None):
        self.optimizer, self.scaler, self.takes = optimizer, scaler, False

    def step(self, closure=None):
        if self.takes:
            self.optimizer.step()


def test_a_wrapped_optimizer_is_attached_through_the_optimizer_it_wraps_with_its_scaler():
    f, _ = make_pair("zloss")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = Wrapper(dummy_optimizer(), scaler)
    f.attach(opt)
    assert f.attached and f.pending.scaler is scaler and f.current_loss_scale() == 4.0
    (H1, i1), *_ = micro_batches()
    (f(H1, i1) * 4.0).backward()
    opt.step()  # inside a window: the wrapped optimizer does not step, nor does the head
    assert int(f.steps) == 0 and f.pending_rows == H1.shape[0]
    opt.takes = True
    opt.step()
    assert int(f.steps) == 1 and f.pending_rows == 0


def test_an_optimizer_without_step_hooks_is_refused_in_one_line_and_nothing_attached():
    f, _ = make_pair("zloss")
    with pytest.raises(TypeError, match=r"^attach\(\) needs an optimizer with torch's step hooks: Wrapper did not "
                                        r"run torch\.optim\.Optimizer\.__init__ \(attach the optimizer it wraps\)$"):
        f.attach(Wrapper(None))
    # not an Optimizer, though it holds one (Lightning's LightningOptimizer): its scaler is the loop's
    with pytest.raises(TypeError, match=r"^attach\(\) needs a torch\.optim\.Optimizer, got SimpleNamespace \(in "
                                        r"Lightning, the HeadSteps callback attaches the head: .*\)$"):
        f.attach(types.SimpleNamespace(optimizer=dummy_optimizer()))
    assert not f.attached and f.pending.scaler is None


def test_detach_steps_in_backward_again():
    f, _ = make_pair("zloss")
    opt = dummy_optimizer()
    f.attach(opt)
    (H1, i1), *_ = micro_batches()
    f(H1, i1).backward()
    f.detach()
    assert not f.attached and f.pending_rows == 0
    opt.step()
    assert int(f.steps) == 0
    f(H1, i1).backward()
    assert int(f.steps) == 1


# -- loss scaling -----------------------------------------------------------------------------
def body_and_head(loss="zloss"):
    torch.manual_seed(3)
    body = torch.nn.Linear(6, 8, dtype=torch.float64)
    head, _ = make_pair(loss, lr=0.1)
    return body, head


def train(body, head, batches, scaler=None, attach=True, poison=()):
    """SGD on the body; the head attached (or told the scale by hand). ``poison``: the steps
    whose body gradient is made non-finite, so that the scaler skips them."""
    opt = torch.optim.SGD(body.parameters(), lr=0.05)
    if attach:
        head.attach(opt, scaler)
    for i, (x, idx) in enumerate(batches):
        opt.zero_grad()
        loss = head(body(x), idx)
        if i in poison:
            loss = loss + body.bias.sum() * torch.tensor(float("inf"), dtype=torch.float64)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        if not attach:
            head.loss_scale = scaler.get_scale()  # the one-line way without attach
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return opt


def scaled_batches(n=4):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randint(0, 60, (5, 2), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("attach", [True, False])
def test_grad_scaler_scale_is_divided_out_of_the_head_step(attach):
    batches = scaled_batches()
    body0, head0 = body_and_head()
    train(body0, head0, batches)
    body, head = body_and_head()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    train(body, head, batches, scaler, attach=attach)
    assert int(head.steps) == len(batches)
    assert rel(head.weight(), head0.weight()) < 1e-12  # a power-of-two scale: exact up to rounding
    assert rel(body.weight, body0.weight) < 1e-12
    assert head.current_loss_scale() == scaler.get_scale()  # the scale the head divides out, however told


@pytest.mark.parametrize("which", [0, 1])
def test_a_scaled_loss_reaching_an_attached_head_with_no_scaler_is_warned(which):
    """attach(optimizer) in a loop whose GradScaler the head was not given: the gradient it gets
    is the loss scale, more than any accumulation's 1/N, and a warning names the fix."""
    batches = scaled_batches(2)
    body, _ = body_and_head()
    head = make_pair("zloss", lr=0.1)[which]  # factored (flags read by head.sync()) and naive (at once)
    opt = torch.optim.SGD(body.parameters(), lr=0.05)
    head.attach(opt)  # the scaler not passed
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with pytest.warns(UserWarning, match=r"multiplied by 65536 while it waits for the optimizer's step.*"
                                         r"pass it: head\.attach\(optimizer, scaler\)$"):
        for x, idx in batches:
            scaler.scale(head(body(x), idx)).backward()
            scaler.step(opt)
            scaler.update()
        head.sync()


@pytest.mark.parametrize("which", [0, 1])
def test_a_ranks_share_of_the_worlds_loss_is_not_warned_but_more_is(which):
    """Where the loss is the world's mean (the HF Trainer's average_tokens_across_devices multiplies
    a rank's loss by the number of processes), a rank holding more than its share of the tokens
    hands its head up to that number; past it, the loss scaler not attached is warned."""
    body, _ = body_and_head()
    for factor, warned in ((1.5, False), (4.0, True)):
        head = make_pair("zloss", lr=0.1)[which]
        head.processes.pg = ProcessGroup(world=2)  # as a rank of two sees it (the step itself is one process's)
        opt = torch.optim.SGD(body.parameters(), lr=0.05)
        head.attach(opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, idx in scaled_batches(2):
                (head(body(x), idx) * factor).backward()
                opt.step()
            head.sync()
        assert any("multiplied by" in str(w.message) for w in caught) == warned, factor


def test_accumulated_micro_batches_of_an_attached_head_are_not_warned():
    body, head = body_and_head()
    opt = torch.optim.SGD(body.parameters(), lr=0.05)
    head.attach(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, idx in scaled_batches(4):
            (head(body(x), idx) / 2).backward()
        opt.step()
        head.sync()
    assert int(head.steps) == 1


def test_head_skips_its_step_when_the_scaler_skips():
    batches = scaled_batches()
    body0, head0 = body_and_head()
    train(body0, head0, batches[1:])  # the reference never sees the poisoned first batch
    body, head = body_and_head()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    train(body, head, batches, scaler, poison=(0,))
    assert scaler.get_scale() == 2.0 ** 15  # it skipped once
    assert head.scaler_skips == 1 and int(head.steps) == len(batches) - 1
    assert rel(head.weight(), head0.weight()) < 1e-12
    assert rel(body.weight, body0.weight) < 1e-12


def test_loss_scale_is_validated():
    _, head = body_and_head()
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="loss_scale"):
            head.loss_scale = bad


# -- one step per forward; eval mode -----------------------------------------------------------
@pytest.mark.parametrize("which", [0, 1])
def test_gradient_norm_by_autograd_grad_then_backward_steps_once(which):
    (f, ref_f), (n, ref_n) = twins("spherical_softmax", lr=0.2)
    head, ref = ((f, ref_f), (n, ref_n))[which]
    torch.manual_seed(4)
    body = torch.nn.Linear(6, 8, dtype=torch.float64)
    x, idx = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 60, (4, 2))
    ref(body(x), idx).backward()  # the reference: one plain training step
    g_ref = body.weight.grad.clone()
    body.zero_grad()
    loss = head(body(x), idx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (g,) = torch.autograd.grad(loss, [body.weight], retain_graph=True)  # a gradient norm
        loss.backward()
        loss2 = head(body(x), idx)  # a second iteration: warned about once only
        torch.autograd.grad(loss2, [body.weight], retain_graph=True)
        loss2.backward()
    assert sum("second backward" in str(w.message) for w in caught) == 1
    assert int(head.steps) == 2
    assert rel(g, g_ref) < 1e-12
    ref(body(x), idx).backward()  # the reference's second step
    assert rel(head.weight(), ref.weight()) < 1e-12


def test_a_second_backward_hands_on_the_same_gradient():
    f, _ = make_pair("zloss", lr=0.2)
    H, idx = batch(4, 8, 60, 2)
    Hc = H.clone().requires_grad_()
    loss = f(Hc, idx)
    (g1,) = torch.autograd.grad(loss, Hc, retain_graph=True)
    W1 = f.weight()
    with pytest.warns(UserWarning, match="second backward"):
        (g2,) = torch.autograd.grad(3.0 * loss, Hc)
    assert torch.allclose(g2, 3.0 * g1, rtol=1e-13) and torch.equal(f.weight(), W1) and int(f.steps) == 1


@pytest.mark.parametrize("which", [0, 1])
def test_eval_mode_hands_the_body_its_gradient_and_freezes_the_head(which):
    (f, ref_f), (n, ref_n) = twins("taylor_softmax", lr=0.2)
    head, probe = ((f, ref_f), (n, ref_n))[which]
    H, idx = batch(4, 8, 60, 2)
    Ht = H.clone().requires_grad_()
    probe(Ht, idx).backward()  # the gradient a training step hands on
    W0 = head.weight()
    head.eval()
    He = H.clone().requires_grad_()
    with pytest.warns(UserWarning, match="eval mode"):
        head(He, idx).backward()
    assert rel(He.grad, Ht.grad) < 1e-12
    assert torch.equal(head.weight(), W0) and int(head.steps) == 0
    with torch.no_grad():  # evaluation as before: no graph
        assert not head(H, idx).requires_grad


def test_scaled_and_accumulated_is_one_unscaled_step_on_the_union():
    pairs = twins("spherical_softmax", lr=0.2)
    (H1, i1), (H2, i2), _ = micro_batches()
    Hu, iu = union([(H1, i1), (H2, i2)])
    M = len(Hu)
    for head, ref in pairs:
        ref(Hu, iu).backward()
        param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.SGD([param], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        head.attach(opt, scaler)
        for H, idx in ((H1, i1), (H2, i2)):
            scaler.scale(head(H, idx) * (len(H) / M) + 0 * param.sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert int(head.steps) == 1 and rel(head.weight(), ref.weight()) < 1e-12


# -- rows belong to the optimizer step that owns them ------------------------------------------
def test_a_window_kept_with_no_optimizer_step_raises_with_the_fix():
    """attach(accumulate=2): a loop that raised inside its window and then trains with plain
    backward calls does not keep rows forever: the next training forward raises."""
    f, _ = make_pair("zloss")
    opt = dummy_optimizer()
    f.attach(opt, accumulate=2)
    (H1, i1), (H2, i2), (H3, i3) = micro_batches()
    f(H1, i1).backward()
    f(H2, i2).backward()
    W0 = f.weight()
    with pytest.raises(RuntimeError, match=r"head\.detach\(\)"):
        f(H3, i3)
    assert f.pending_rows == 8 and torch.equal(f.weight(), W0) and int(f.steps) == 0
    opt.step()  # the window's step comes after all: one step, and the head goes on
    assert int(f.steps) == 1
    f(H3, i3).backward()
    f.detach()
    f(H3, i3).backward()
    assert int(f.steps) == 2
    with pytest.raises(ValueError, match="accumulate"):
        f.attach(opt, accumulate=0)
    with pytest.raises(ValueError, match="accumulate must be a positive int or None, got True"):
        f.attach(opt, accumulate=True)
    assert not f.attached


def test_a_loop_that_skips_a_step_drops_the_kept_rows_with_the_bodys_gradients():
    """A loop that skips an optimizer step on purpose (a non-finite loss, a spike) calls
    ``discard_pending_step()`` where it zeroes the gradients: the next window's step is the head's
    step on that window alone, bit for bit a head's that never saw the skipped one; without it, the
    next window's forward raises with that fix in its one line."""
    (f, ref), _ = twins("zloss")
    (H1, i1), (H2, i2), (H3, i3) = micro_batches()
    opt, ref_opt = dummy_optimizer(), dummy_optimizer()
    f.attach(opt, accumulate=2)
    ref.attach(ref_opt, accumulate=2)
    f(H1, i1).backward()
    f(H2, i2).backward()
    with pytest.raises(RuntimeError, match=r"head\.discard_pending_step\(\) where it zeroes the gradients"):
        f(H3, i3)
    opt.zero_grad()
    f.discard_pending_step()  # the window skipped: the head's rows dropped with the body's gradients
    assert f.pending_rows == 0 and int(f.steps) == 0 and f.attached
    for head, optimizer in ((f, opt), (ref, ref_opt)):
        head(H3, i3).backward()
        head(H2, i2).backward()
        optimizer.step()
    assert int(f.steps) == int(ref.steps) == 1 and torch.equal(f.weight(), ref.weight())


def test_a_head_whose_optimizer_is_gone_drops_its_rows_and_steps_again():
    f, _ = make_pair("zloss")
    opt = dummy_optimizer()
    f.attach(opt)
    (H1, i1), (H2, i2), _ = micro_batches()
    f(H1, i1).backward()
    del opt
    with pytest.warns(UserWarning, match="optimizer it was attached to is gone"):
        loss = f(H2, i2)
    loss.backward()
    assert not f.attached and f.pending_rows == 0 and int(f.steps) == 1
