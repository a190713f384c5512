"""Batches of any size through the compiled step (batch_shapes.py): 30 batches of random sizes,
m = 1 among them, on every route (fused, autograd, exact accumulation), with K > 1, padding,
repeated classes, sampled classes (shared and per row) and the preconditioner, equal to the
eager step on the same rows to 1e-12 in float64, with at most one graph a batch size and never
Dynamo's recompile limit; a resumed head steps bit for bit; the sizes' rule and setting."""
import io

import pytest
import torch
from torch._dynamo.utils import counters

from lst_lightning.spherical import FactoredSphericalHead, driver
from lst_lightning.spherical.batch_shapes import MIN_ROWS, padded_rows, padded_slots
from lst_lightning.spherical.driving import BATCH_SIZES, Driving

from head_pairs import rel

D, d = 300, 8
SHARED = dict(loss="sampled", negatives=dict(num=8, seed=3), preconditioner={})  # lst-train's default head
PER_ROW = dict(loss="sampled", negatives=dict(num=4, seed=3, shared=False), preconditioner={})
ZLOSS = dict(loss="zloss")
KINDS = {"shared": SHARED, "per_row": PER_ROW, "zloss": ZLOSS}


@pytest.fixture
def aot_eager(monkeypatch):
    """Dynamo and AOTAutograd without Inductor's code generation (the same graphs, a fraction of
    the compile time); Dynamo's caches emptied before and after, so each test counts its own."""
    torch._dynamo.reset()
    counters.clear()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", **kw))
    monkeypatch.setattr(driver, "_compiled", {})
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def head(kind, compile_step, **kw):
    return FactoredSphericalHead(D, d, **KINDS[kind], lr=0.1, weight_decay=0.01, dtype=torch.float64,
                                 compile_step=compile_step, generator=torch.Generator().manual_seed(0), **kw)


def sizes(n=30, most=32, seed=0) -> list[int]:
    """n random batch sizes up to ``most``, m = 1 first."""
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(1, most + 1, (n - 1,), generator=g).tolist()


def batch(m, g):
    """m rows of K = 1 or 3 slots: padding, a class repeated in a row, classes shared across rows."""
    K = 1 + 2 * int(torch.randint(0, 2, (), generator=g))
    H = torch.randn(m, d, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 40, (m, K), generator=g)
    idx[0, -1] = -1 if K > 1 else idx[0, -1]
    if K > 1:
        idx[-1, 1] = idx[-1, 0]
    return H, idx


def expected_graphs(ms, Ks, parts=1) -> int:
    return parts * len({(padded_rows(m, BATCH_SIZES), padded_slots(K)) for m, K in zip(ms, Ks)})


def drive(route, eager, fast, ms, seed=1):
    """The same batches through both heads on ``route``: the worst relative gap of the losses and
    dL/dH, and the slot counts met."""
    g = torch.Generator().manual_seed(seed)
    opts = [torch.optim.SGD([torch.zeros(1, requires_grad=True)]) for _ in range(2)]
    if route == "accumulated":
        for h, opt in zip((eager, fast), opts):
            h.attach(opt)
    if route == "fused":
        eager.step = fast.step = "fused"
    worst, Ks = 0.0, []
    for i, m in enumerate(ms):
        H, idx = batch(m, g)
        Ks.append(idx.shape[1])
        Hs = [H.clone().requires_grad_() for _ in range(2)]
        losses = [h(x, idx) for h, x in zip((eager, fast), Hs)]
        for L in losses:
            L.backward()
        if route == "accumulated" and i % 2 == 1:
            for opt in opts:
                opt.step()
        worst = max(worst, rel(losses[1], losses[0]), rel(Hs[1].grad, Hs[0].grad))
    return worst, Ks


#: lst-train's default head on the autograd route (its backward takes the forward's saved state,
#: padded); the fused route, accumulation (which pads the union of two batches) and the other
#: losses: -m slow (the padding is the same code; the fused step takes random batch sizes in
#: test_batch_sizes_and_neumann_factors_past_any_fixed_limit_never_stop_the_step, accumulation
#: changing ones in test_host_reads.py)
FAST_ROUTES = {("autograd", "shared")}
ROUTES = [pytest.param(route, kind, marks=[] if (route, kind) in FAST_ROUTES else pytest.mark.slow)
          for route in ("fused", "autograd", "accumulated") for kind in sorted(KINDS)]


#: under accumulation batches of up to 16 rows (one batch size: the fused route's 30 sizes up to 32
#: cross it), whose unions of two (up to 32 rows) pad to two sizes: the records' step, compiled a
#: size a union, half the graphs of batches up to 32
MOST = {"accumulated": 16}


@pytest.mark.parametrize("route,kind", ROUTES)
def test_thirty_random_batch_sizes_compile_once_a_size_and_equal_the_eager_step(aot_eager, route, kind):
    ms = sizes(most=MOST.get(route, 32))
    eager, fast = head(kind, False), head(kind, True)
    worst, Ks = drive(route, eager, fast, ms)
    for h in (eager, fast):
        h.apply_pending_step()
        h.sync()
    worst = max(worst, rel(fast.weight(), eager.weight()), rel(fast.input_moment, eager.input_moment))
    assert worst <= 1e-12, worst
    assert int(fast.steps) == int(eager.steps) > 0 and int(fast.skipped_nonfinite) == 0
    if route == "accumulated":  # the forward's graphs (a size a batch) and the records' (a size a union)
        Kp = [max(Ks[i:i + 2]) for i in range(0, len(ms), 2)]
        want = expected_graphs(ms, Ks) + expected_graphs([a + b for a, b in zip(ms[::2], ms[1::2])], Kp)
    else:
        want = expected_graphs(ms, Ks, parts=1 if route == "fused" else 2)
    assert graphs() <= want, (graphs(), want)


def test_a_resumed_head_steps_bit_for_bit_on_new_batch_sizes(aot_eager):
    fast = head("shared", True)
    fast.step = "fused"
    g = torch.Generator().manual_seed(2)
    for m in (5, 40):
        fast.train_step(*batch(m, g))
    buf = io.BytesIO()
    torch.save(fast.state_dict(), buf)
    buf.seek(0)
    again = head("shared", True)
    again.step = "fused"
    again.load_state_dict(torch.load(buf, weights_only=False))
    for m in (1, 17, 40, 3):
        H, idx = batch(m, g)
        a, b = fast.train_step(H, idx), again.train_step(H, idx)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and a[1].shape == (m, d)
    assert torch.equal(fast.weight(), again.weight())


@pytest.mark.slow  # past any limit: test_batch_sizes_and_neumann_factors_past_any_fixed_limit_never_stop_the_step
def test_more_batch_sizes_than_dynamos_limit_never_hit_it(aot_eager):
    """Three batch sizes (set by hand), one graph each, past a recompile limit of 2: the step runs
    under its own limit (one graph a key met, ``driver.graph_key``), whatever the loop's."""
    fast = head("zloss", True, batch_sizes=(1, 2, 3))
    fast.step = "fused"
    g = torch.Generator().manual_seed(3)
    # (the config's own patch: a monkeypatch of a torch config module deletes the key at its undo)
    with torch._dynamo.config.patch(recompile_limit=2):
        for m in (1, 2, 3, 2):
            H = torch.randn(m, d, generator=g, dtype=torch.float64)
            fast.train_step(H, torch.randint(0, D, (m,), generator=g))
        assert graphs() == 3 > torch._dynamo.config.recompile_limit


def test_the_sizes_rule_and_setting():
    assert [padded_rows(m, "pow2") for m in (1, MIN_ROWS, MIN_ROWS + 1, 1000, 1024, 1025)] == \
        [MIN_ROWS, MIN_ROWS, 2 * MIN_ROWS, 1024, 1024, 2048]
    assert [padded_rows(m, (5, 100)) for m in (1, 5, 6, 100, 101)] == [5, 5, 100, 100, 128]
    assert [padded_slots(K) for K in (1, 2, 3, 5)] == [1, 2, 4, 8]
    # over any sizes up to M, at most log2(M) + 2 graphs
    for M in (1, 7, 100, 1000, 10 ** 6):
        assert len({padded_rows(m, BATCH_SIZES) for m in range(1, M + 1, max(1, M // 5000))}) <= \
            max(1, M - 1).bit_length() + 2
    h = FactoredSphericalHead(D, d, batch_sizes=[64, 8, 8])
    assert h.batch_sizes == (8, 64) and Driving().batch_sizes == BATCH_SIZES == "pow2"
    for bad in (0, "powers", (), (3, 0), (2.5,), (True,)):
        with pytest.raises(ValueError, match="batch_sizes must be") as err:
            h.batch_sizes = bad
        assert "\n" not in str(err.value)
    assert h.batch_sizes == (8, 64)


def test_batch_sizes_and_neumann_factors_past_any_fixed_limit_never_stop_the_step(aot_eager, monkeypatch):
    """The products route under the adaptive rule (a GPU's default) compiles a graph for each
    batch size and number of Neumann factors a run meets: Dynamo's limit follows the keys met
    (``driver.graph_key``), with room for one more here, so the step never stops where a fixed
    limit would (64 graphs: 13 batch sizes under 5 factor counts); and it equals the eager step,
    its factors too."""
    monkeypatch.setattr(driver, "RECOMPILE_LIMIT", 1)
    kw = dict(stabiliser=dict(inverse="products", neumann="adaptive"), sync_every=2)
    fast, slow = head("zloss", True, **kw), head("zloss", False, **kw)
    fast.step = slow.step = "fused"
    g = torch.Generator().manual_seed(5)
    keys = set()
    for i, m in enumerate([1, 20, 40, 80, 20, 1, 40, 80, 160, 20]):
        for h in (fast, slow):
            h.lr = (0.02, 0.3)[i % 2]  # rho's bound moves the factors at each read
        H, idx = batch(m, g)
        keys.add((padded_rows(m, BATCH_SIZES), padded_slots(idx.shape[1]), fast.step_checks.factors))
        a, b = fast.train_step(H, idx), slow.train_step(H, idx)
        assert rel(a[1], b[1]) < 1e-12 and rel(a[0], b[0]) < 1e-12
        assert fast.step_checks.factors == slow.step_checks.factors
    assert rel(fast.weight(), slow.weight()) < 1e-12
    assert len({k[2] for k in keys}) > 1, "the factors never moved"
    assert len(keys) > 1 + driver.RECOMPILE_LIMIT and graphs() == len(keys)


def test_the_step_takes_and_prepares_the_route_of_the_rows_it_runs(aot_eager):
    """The U^-1 route is chosen once, before the step, for the rows its device part takes: a
    compiled step's batch size. On a CPU past ``woodbury_rows`` (width // 2 = 4 here) a step solves
    with U_new and leaves U^-1 behind; a batch of 3 rows pads to 16 and solves too, so U^-1 is never
    refreshed for it, where the eager step takes Woodbury for the same 3 rows and refreshes U^-1
    first. The steps are the same to 1e-12."""
    fast, eager = head("zloss", True), head("zloss", False)
    fast.step = eager.step = "fused"
    g = torch.Generator().manual_seed(4)
    for m in (40, 3, 40, 3, 3):
        H, idx = batch(m, g)
        a, b = fast.train_step(H, idx), eager.train_step(H, idx)
        assert rel(a[0], b[0]) < 1e-12 and rel(a[1], b[1]) < 1e-12
    assert rel(fast.weight(), eager.weight()) < 1e-12
    assert fast.uinv_refreshes == 0 and eager.uinv_refreshes == 2
