"""The step's device part compiled whole (driver.py): one graph with no break, equal to the
eager step in float64 to 1e-12 (Inductor's fused loops reorder sums: rounding), to the naive
head, bit for bit on resume within the compiled mode, and no recompile across lr changes,
batches of one shape or a resumed head. On every route: the fused step, the autograd step
(forward and backward, two graphs) and exact accumulation. ``compile_step=True`` is refused
in one line where the step cannot be compiled."""
import dataclasses
import io

import pytest
import torch
from torch._dynamo.utils import counters

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead, driver
from lst_lightning.spherical import exact_step, negatives

from head_pairs import rel
from random_cases import run_case

D, d, m, K = 300, 8, 12, 3
DEFAULT = dict(loss="sampled", negatives=dict(num=8, seed=3), preconditioner={})  # lst-train's default head
ZLOSS = dict(loss="zloss")
CLIPPED = dict(DEFAULT, clip_norm=0.05)  # lst-train's default head with a bound that every step's gradient passes


@pytest.fixture
def fresh():
    """Dynamo's caches emptied before and after: each test counts its own graphs."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch, fresh):
    """Dynamo and AOTAutograd without Inductor's code generation: the same graphs and their
    functionalised mutations in a fraction of the compile time."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    monkeypatch.setattr(driver, "_compiled", {})


def head(kind, compile_step, dtype=torch.float64, **kw):
    return FactoredSphericalHead(D, d, **kind, lr=0.1, weight_decay=0.01, dtype=dtype, compile_step=compile_step,
                                 generator=torch.Generator().manual_seed(0), **kw)


def batches(n, seed=0):
    """K > 1 targets with padding, a class repeated in a row and classes shared across rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        H = torch.randn(m, d, generator=g, dtype=torch.float64)
        idx = torch.randint(0, 40, (m, K), generator=g)
        idx[0, -1] = -1
        idx[1, 1] = idx[1, 0]
        idx[2, 0] = idx[0, 0]
        out.append((H, idx))
    return out


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("kind", [ZLOSS, DEFAULT, pytest.param(CLIPPED, marks=pytest.mark.slow)],
                         ids=["zloss", "default", "clipped"])
def test_every_device_part_traces_as_one_graph_without_a_break(kind):
    h = head(kind, False)
    H, idx = batches(1)[0]
    Hx, idx, T = h.prepare(H, idx, None, step=True)
    draws, route = driver.before_step(h, m)
    plan, state, batch, lr = h.plan, driver.step_state(h), exact_step.Batch(Hx, idx, T), h.device_lr()
    explained = torch._dynamo.explain(exact_step.device_step)(plan, state, batch, lr, draws, route)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    if kind is not ZLOSS:  # the autograd step's two halves and exact accumulation's step
        _, fwd = exact_step.forward(plan, state, batch, draws, route)
        for fn, args in ((exact_step.forward, (batch, draws, route)),
                         (exact_step.update, (fwd, Hx.new_ones(()), lr)),
                         (exact_step.records_step, (Hx, idx, fwd.gq, fwd.gs, fwd.GA, fwd.real, fwd.input_ok,
                                                     fwd.neg.cols, fwd.neg.G_neg, lr, route))):
            explained = torch._dynamo.explain(fn)(plan, state, *args)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), (fn, explained.break_reasons)


def defaults(cls) -> dict:
    """The field defaults of a dataclass or a NamedTuple."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return dict(getattr(cls, "_field_defaults", {}))


def test_what_the_device_part_builds_defaults_to_plain_values_only():
    """Dynamo of torch 2.11 (the GPU machine's) cannot trace the construction of a dataclass or a
    NamedTuple inside the compiled step whose defaults hold an object of the project's own (a
    graph break there, where torch 2.13 traces it; the suite runs 2.13): every such default is
    None, a bool, an int, a float or a str. ``Batch`` is built by the host driver, outside."""
    built_inside = [c for module in (exact_step, negatives) for c in vars(module).values()
                    if isinstance(c, type) and c.__module__ == module.__name__
                    and (dataclasses.is_dataclass(c) or hasattr(c, "_field_defaults")) and c is not exact_step.Batch]
    assert {"SavedForward", "NewState", "Flags", "Forms", "Inverse", "SharedBlock"} <= {c.__name__ for c in built_inside}
    for cls in built_inside:
        for name, value in defaults(cls).items():
            assert value is None or isinstance(value, (bool, int, float, str)), (cls.__name__, name, value)


def test_the_compiled_default_step_equals_the_eager_and_the_naive_head(fresh):
    """Inductor: 30 fused steps of lst-train's default head (sampled classes, the right
    preconditioner) in float64, the lr changed every 10 steps, against the same head eager
    (1e-12: the fused loops sum in another order) and the naive head (1e-9, as every pair
    test); one graph for all of it, none more for a resumed head, which steps bit for bit as
    the head it was saved from."""
    eager, fast = head(DEFAULT, False), head(DEFAULT, True)
    naive = NaiveSphericalHead(D, d, **DEFAULT, lr=0.1, weight_decay=0.01, dtype=torch.float64)
    naive.reset_weight(eager.weight())
    for h in (eager, fast):
        h.step = "fused"
    assert fast.compiles and not eager.compiles
    worst = {"eager": 0.0, "naive": 0.0}
    for i, (H, idx) in enumerate(batches(30)):
        if i % 10 == 9:
            for h in (eager, fast, naive):
                h.lr *= 0.9
        Hs = [H.clone().requires_grad_() for _ in range(3)]
        losses = [h(x, idx) for h, x in zip((eager, fast, naive), Hs)]
        for L in losses:
            L.backward()
        worst["eager"] = max(worst["eager"], rel(losses[1], losses[0]), rel(Hs[1].grad, Hs[0].grad))
        worst["naive"] = max(worst["naive"], rel(losses[1], losses[2]), rel(Hs[1].grad, Hs[2].grad))
    fast.sync(), eager.sync()
    worst["eager"] = max(worst["eager"], rel(fast.weight(), eager.weight()), state_gap(eager, fast))
    worst["naive"] = max(worst["naive"], rel(fast.weight(), naive.weight()))
    assert worst["eager"] <= 1e-12 and worst["naive"] <= 1e-9, worst
    assert int(fast.steps) == 30 and graphs() == 1  # no recompile across lr changes and batches
    # resume within the compiled mode: bit for bit, with the same graph
    buf = io.BytesIO()
    torch.save(fast.state_dict(), buf)
    buf.seek(0)
    again = head(DEFAULT, True)
    again.step = "fused"
    again.load_state_dict(torch.load(buf, weights_only=False))
    for H, idx in batches(5, seed=1):
        a, b = (h.train_step(H, idx) for h in (fast, again))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(fast.weight(), again.weight()) and graphs() == 1


def state_gap(a, b) -> float:
    """The worst relative gap between every buffer of two heads' states (their counters, cond(U)'s
    carried bound, the preconditioner's moments and their weight among them: each must be equal)
    and the Neumann factors their flags' last reads chose (equal)."""
    assert a.step_checks.factors == b.step_checks.factors
    sa, sb = a.state_dict(), b.state_dict()
    return max(rel(sb[k], sa[k]) if sa[k].is_floating_point() else float(not torch.equal(sa[k], sb[k]))
               for k in sa if isinstance(sa[k], torch.Tensor))


def twins(kind, steps_fn):
    """The same steps on an eager head and a compiled one: (worst relative gap of W and of every
    buffer of the state, the compiled head)."""
    eager, fast = head(kind, False), head(kind, True)
    worst = steps_fn(eager, fast)
    for h in (eager, fast):
        h.sync()
    return max(worst, rel(fast.weight(), eager.weight()), state_gap(eager, fast)), fast


def autograd_steps(eager, fast, n=6):
    worst = 0.0
    for H, idx in batches(n):
        Hs = [H.clone().requires_grad_() for _ in range(2)]
        for h, x in zip((eager, fast), Hs):
            h(x, idx).backward()
        worst = max(worst, rel(Hs[1].grad, Hs[0].grad))
    return worst


def accumulated_steps(eager, fast, n=3, micro=2):
    opts = [torch.optim.SGD([torch.zeros(1, requires_grad=True)]) for _ in range(2)]
    for h, opt in zip((eager, fast), opts):
        h.attach(opt, accumulate=micro)
    data = batches(n * micro)
    for s in range(n):
        for H, idx in data[s * micro:(s + 1) * micro]:
            for h in (eager, fast):
                (h(H.clone().requires_grad_(), idx) / micro).backward()
        for opt in opts:
            opt.step()
    return 0.0


@pytest.mark.parametrize("kind", [pytest.param(ZLOSS, marks=pytest.mark.slow), DEFAULT,
                                  pytest.param(CLIPPED, marks=pytest.mark.slow)],
                         ids=["zloss", "default", "clipped"])  # -m slow: the fused step compiles them too
def test_the_autograd_step_and_exact_accumulation_run_compiled(aot_eager, kind):
    gap, fast = twins(kind, autograd_steps)
    assert gap <= 1e-12 and int(fast.steps) == 6
    assert graphs() == 2  # the forward and the backward, once each
    gap, fast = twins(kind, accumulated_steps)
    assert gap <= 1e-12 and int(fast.steps) == 3
    assert graphs() == 3  # and the records' step


#: settings drawn at random (random_cases.py), compiled: cases and steps a case; the first
#: FAST_CASES in the default suite (test_random_settings.py draws many more, eager), all with -m slow
RANDOM_CASES, RANDOM_STEPS, FAST_CASES = 8, 6, 1


@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s < FAST_CASES else pytest.mark.slow)
                                  for s in range(RANDOM_CASES)])
def test_in_settings_drawn_at_random_the_compiled_step_equals_the_naive_head(aot_eager, seed):
    """``compile_step=True`` in test_random_settings.py's ordinary cases (every setting drawn
    together: the loss, the bias, the reduction, weight decay, the sampled classes, P, the bound on
    the gradient's norm, the U^-1 route and the repairs, the flags' reads, the fused or the
    autograd step, a new batch size every step): each device part compiles whole (``fullgraph``: a
    break raises), and each step's loss, dL/dH and W equal the float64 naive head's to 1e-9
    (``run_case``)."""
    f = run_case(seed, "ordinary", steps=RANDOM_STEPS, compile_step=True)
    assert f.compiles and graphs() >= 1 and int(f.steps) == RANDOM_STEPS


@pytest.mark.parametrize("step", ["autograd", pytest.param("fused", marks=pytest.mark.slow)])
def test_with_sync_every_1_the_step_compiles_checks_each_batch_first_and_equals_the_eager_one(aot_eager, step):
    """``sync_every=1`` compiles the same device part: 6 steps of lst-train's default head equal
    the eager head's (float64, 1e-12) in one graph, the flags read after every step; a batch
    with a bad id raises before the step, and both heads keep every buffer and take the next
    batch as before."""
    eager, fast = (head(DEFAULT, c, sync_every=1) for c in (False, True))
    for h in (eager, fast):
        h.step = step
    assert fast.compiles and not fast.deferred_checks and not eager.compiles
    worst = 0.0
    for i, (H, idx) in enumerate(batches(6)):
        if i == 3:
            bad = idx.clone()
            bad[4, 0] = D
            for h in (eager, fast):
                before = {k: v.clone() for k, v in h.state_dict().items() if torch.is_tensor(v)}
                with pytest.raises(ValueError, match="outside \\[0, 300\\)") as err:
                    h(H.clone().requires_grad_(), bad)
                assert "\n" not in str(err.value)
                assert all(torch.equal(v, h.state_dict()[k]) for k, v in before.items())
        Hs = [H.clone().requires_grad_() for _ in range(2)]
        losses = [h(x, idx) for h, x in zip((eager, fast), Hs)]
        for L in losses:
            L.backward()
        worst = max(worst, rel(losses[1], losses[0]), rel(Hs[1].grad, Hs[0].grad))
        assert int(fast.steps) == int(eager.steps) == i + 1  # read after every step: nothing waits
    worst = max(worst, rel(fast.weight(), eager.weight()), state_gap(eager, fast))
    assert worst <= 1e-12 and graphs() == (2 if step == "autograd" else 1), worst


def test_compile_step_true_is_refused_in_one_line_where_the_step_cannot_compile():
    with pytest.raises(ValueError, match="compile_step=True: .*parallel='sharded' all-reduces") as err:
        FactoredSphericalHead(D, d, compile_step=True, parallel="sharded")
    assert "\n" not in str(err.value)
    h = FactoredSphericalHead(D, d, compile_step=True)
    with pytest.raises(ValueError, match="parallel"):
        h._drive(parallel="sharded")
    assert h.parallel == "none" and h.compiles
    auto = FactoredSphericalHead(D, d)
    assert auto.compile_step == "auto" and not auto.compiles  # auto: on a CUDA device only
    with pytest.raises(ValueError, match="compile must be one of"):
        FactoredSphericalHead(D, d, compile_step="yes")


def settle_neumann_factors(h, steps, reads: int = 6) -> None:
    """``steps()`` then a read of the flags, until a read leaves the Neumann factors as they were
    (each new number of factors is a graph more, compiled, and on a CUDA device captured, at the
    next step): the steps after it compile nothing."""
    for _ in range(reads):
        before = h.step_checks.factors
        steps()
        h.sync()
        if h.step_checks.factors == before:
            return
    raise AssertionError(f"the Neumann factors still change after {reads} reads")


@pytest.mark.slow  # the GPU's route on the CPU; the default suite's compiled steps take no recompile
@pytest.mark.parametrize("route", ["autograd", "fused"])
def test_after_the_factors_settle_the_compiled_steps_compile_nothing(aot_eager, route):
    """The CPU side of test_on_cuda_the_default_step_never_waits_for_the_gpu: after
    settle_neumann_factors, sync_every - 1 steps on the GPU's U^-1 route (products, adaptive
    factors) compile no graph, on each route."""
    h = head(DEFAULT, True, dtype=torch.float32, stabiliser={"inverse": "products"})
    h.step = route
    data = batches(h.sync_every + 2)

    def one(H, idx):
        h(H.clone().requires_grad_(), idx).backward()

    settle_neumann_factors(h, lambda: [one(H, idx) for H, idx in data[:2]])
    compiled, calls = graphs(), h.step_checks.calls
    for H, idx in data[2:2 + h.sync_every - 1 - calls % h.sync_every]:
        one(H, idx)
    assert graphs() == compiled and int(h.steps) >= h.sync_every - 1


# -- on a CUDA device (``-m gpu``; the GPU suite's ``tests`` part) --------------------------------
def cuda_head(kind, compile_step, dtype=torch.float32, num_classes=D, width=d):
    return FactoredSphericalHead(num_classes, width, **kind, lr=0.1, weight_decay=0.01, dtype=dtype, device="cuda",
                                 compile_step=compile_step, generator=torch.Generator().manual_seed(0))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [ZLOSS, DEFAULT], ids=["zloss", "default"])
def test_on_cuda_the_compiled_step_equals_the_eager_one_and_the_naive_head(kind):
    """Inductor's Triton kernels and the project's (traced by Dynamo into the graph): in float64
    the compiled step is the eager one to 1e-12 (every buffer of its state too), in float32 the naive float64 head's to 2e-4 (as
    test_cuda.py's float32 pair), over 50 fused steps with the lr changed."""
    eager, fast = cuda_head(kind, False, torch.float64), cuda_head(kind, True, torch.float64)
    f32 = cuda_head(kind, True)
    naive = NaiveSphericalHead(D, d, **kind, lr=0.1, weight_decay=0.01, dtype=torch.float64, device="cuda")
    # one W for all: a float32 head draws another initial W than a float64 one from the same seed
    naive.reset_weight(eager.weight())
    f32.reset_weight(eager.weight())
    assert fast.compiles and f32.compiles and not eager.compiles
    gap = {"eager": 0.0, "naive": 0.0}
    for i, (H, idx) in enumerate(batches(50)):
        H, idx = H.cuda(), idx.cuda()
        for h in (eager, fast, f32, naive):
            h.lr = 0.1 / (1 + 0.05 * i)
        (Le, ge), (Lf, gf), (L32, g32) = (h.train_step(H, idx) for h in (eager, fast, f32))
        Hn = H.clone().requires_grad_()
        naive(Hn, idx).backward()
        gap["eager"] = max(gap["eager"], rel(Lf, Le), rel(gf, ge))
        gap["naive"] = max(gap["naive"], rel(g32, Hn.grad))
    for h in (eager, fast, f32):
        h.sync()
    gap["eager"] = max(gap["eager"], rel(fast.weight(), eager.weight()), state_gap(eager, fast))
    gap["naive"] = max(gap["naive"], rel(f32.weight(), naive.weight()))
    assert gap["eager"] <= 1e-12 and gap["naive"] <= 2e-4, gap


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fused", "autograd", "accumulated", "cuda_graph"])
def test_on_cuda_the_default_step_never_waits_for_the_gpu(route):
    """Under ``torch.cuda.set_sync_debug_mode("error")`` any host synchronisation raises: the
    default head's compiled step runs sync_every - 1 steps on each route without one (the read of
    the flags, every sync_every steps, is the only one). Its compiles and captures are taken
    before: a graph (and a CUDA graph) for each number of Neumann factors that a read chooses
    (``neumann="adaptive"``), reads until a read leaves them as they were
    (settle_neumann_factors)."""
    h = cuda_head(DEFAULT, True)
    data = [(H.cuda(), idx.cuda()) for H, idx in batches(h.sync_every + 2)]
    opt = torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)])
    if route == "accumulated":
        h.attach(opt)
    if route in ("fused", "cuda_graph"):
        h.step = route

    def one(H, idx):
        h(H.clone().requires_grad_(), idx).backward()
        if route == "accumulated":
            opt.step()

    settle_neumann_factors(h, lambda: [one(H, idx) for H, idx in data[:2]])
    calls, compiled = h.step_checks.calls, graphs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for H, idx in data[2:2 + h.sync_every - 1 - calls % h.sync_every]:
            one(H, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    h.sync()
    assert int(h.skipped_nonfinite) == 0 and int(h.steps) >= h.sync_every - 1
    assert graphs() == compiled  # nothing compiled in the checked steps


@pytest.mark.gpu
def test_on_cuda_the_compiled_step_updates_v_in_place_without_a_copy_of_it():
    """V (D x d, 1 GB here) is written in place by the compiled step: its storage stays, and the
    step's peak memory above what was allocated before it stays far below one copy of V."""
    D_big, d_big = 2_000_000, 128
    h = cuda_head(DEFAULT, True, num_classes=D_big, width=d_big)
    H = torch.randn(256, d_big, device="cuda")
    idx = torch.randint(0, D_big, (256, 2), device="cuda")
    h.train_step(H, idx)  # compiles
    ptr, v_bytes = h.V.data_ptr(), h.V.numel() * h.V.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        h.train_step(H, idx)
    torch.cuda.synchronize()
    assert h.V.data_ptr() == ptr
    assert torch.cuda.max_memory_allocated() - before < v_bytes / 8


def test_a_model_compiled_with_fullgraph_says_why_the_head_stays_out_of_its_graph():
    """``torch.compile(model, fullgraph=True)`` cannot take the head (its forward is
    ``torch.compiler.disable``d: it runs outside a compiled model's graphs and compiles its own
    step). Dynamo's error says why and what to do, where it said "Remove the disable call";
    without fullgraph the compiled model trains the head."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(6, 8), FactoredSphericalHead(num_classes=40, hidden_dim=8)

        def forward(self, x, y):
            return self.head(self.body(x), y)

    model = Model()
    x, y = torch.randn(4, 6), torch.randint(0, 40, (4,))
    with pytest.raises(Exception, match="compile the model without fullgraph=True, or its body alone"):
        torch.compile(model, fullgraph=True, backend="eager")(x, y)
    torch.compile(model, backend="eager")(x, y).backward()
    assert int(model.head.steps) == 1
