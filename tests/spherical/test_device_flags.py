"""The factored head's training step with no host synchronisation (``sync_every > 1``):
exact against the naive head, no read of a device value inside the step, and bad or
non-finite input still skipped, state untouched, and reported at the next read."""
import copy
import warnings

import pytest
import torch

from lst_lightning.spherical import NaiveSphericalHead
from lst_lightning.distributed.fixed_exchange import FirstFault

from head_pairs import (D, assert_untouched, batch, d, deferred, make_pair, no_host_reads, run_steps, state,
                        state_of, step)
from host_reads import HostReads


@pytest.mark.parametrize("loss", ["zloss", "spherical_softmax", "mse"])
@pytest.mark.parametrize("m", [3, 16])  # Woodbury and direct solves
def test_deferred_step_is_exact(loss, m):
    torch.manual_seed(0)
    f, n = make_pair(loss, bias=True, lr=0.05, weight_decay=0.01)
    g = deferred(loss=loss, loss_kwargs=f.loss_fn.hparams(), weight_decay=0.01, sync_every=3)
    g.reset_weight(f.weight())
    run_steps(g, n, steps=40, m=m, K=3, tol=1e-9)
    assert int(g.steps) == 40 and int(g.skipped_nonfinite) == 0


@pytest.mark.parametrize("inverse,m", [("auto", 5), ("products", 5), ("products", 12)])
def test_deferred_step_reads_nothing_on_the_host(monkeypatch, inverse, m):
    head = deferred(sync_every=10, stabiliser={"inverse": inverse})
    batches = [batch(m, d, D, 3) for _ in range(9)]
    with no_host_reads(monkeypatch):
        for H, idx in batches:
            head(H.requires_grad_(), idx).backward()
    assert head.step_checks.synced == (0, 0)  # not read yet
    H, idx = batch(m, d, D, 3)
    head(H.requires_grad_(), idx).backward()  # the 10th step reads the flags
    assert head.step_checks.synced == (10, 0)


def test_sync_mode_reads_the_host(monkeypatch):
    """The test above can fail: the default head (sync_every=1) does read device values."""
    head = deferred(sync_every=1)
    H, idx = batch(5, d, D, 3)
    with no_host_reads(monkeypatch), pytest.raises(AssertionError, match="read a device value"):
        head(H.requires_grad_(), idx).backward()


def test_bad_target_is_skipped_then_reported():
    head = deferred(sync_every=3)
    H, idx = batch(5, d, D, 3)
    step(head, H, idx)
    before = state(head)
    bad = idx.clone()
    bad[2, 1] = D + 7
    grad = step(head, H, bad)  # no error yet: nothing is read inside the step
    assert state(head) == before and torch.equal(grad, torch.zeros_like(grad))
    with pytest.raises(ValueError, match=r"the batch of step 2 had target ids outside \[0, 60\)"):
        step(head, H, idx)  # the 3rd step reads the flag
    assert int(head.steps) == 2 and int(head.skipped_nonfinite) == 1
    step(head, H, idx)  # the flag was cleared
    assert int(head.steps) == 3


def test_the_report_of_a_bad_target_names_the_heads_padding_id():
    """A head whose padding is ``ignore_index=-100`` (Hugging Face's labels) is told so."""
    head = deferred(sync_every=3, ignore_index=-100)
    H, idx = batch(5, d, D, 3)
    idx[2, 1] = D
    step(head, H, idx)
    with pytest.raises(ValueError, match=r"outside \[0, 60\) \(class ids, or -1 or ignore_index \(-100\) for padding\)"):
        head.sync()


def test_non_finite_step_is_skipped_counted_and_warned():
    head = deferred(sync_every=2)
    H, idx = batch(5, d, D, 1)
    step(head, H, idx)
    before = state(head)
    H_bad = H.clone()
    H_bad[1, 3] = float("nan")
    with pytest.warns(RuntimeWarning, match="1 step"):
        step(head, H_bad, idx)
    assert state(head) == before
    assert (int(head.steps), int(head.skipped_nonfinite)) == (1, 1)


def void_batch(H, idx, bad: str):
    """A copy of the batch made void: a target id out of range ("ids"), or a nan or inf in H."""
    H_bad, idx_bad = H.clone(), idx.clone()
    if bad == "ids":
        idx_bad[2, 1] = D + 7
    else:
        H_bad[1, 3] = float(bad)
    return H_bad, idx_bad


@pytest.mark.parametrize("bad", ["ids", "nan"])
@pytest.mark.parametrize("sync_every", [1, 3])
def test_a_void_step_changes_only_its_count_and_the_draws_stream(bad, sync_every):
    """A void step (bad target ids under device flags, a non-finite H) leaves the head as a twin
    that never saw the batch, but for the skip's count and the sampled classes' generator, which
    moves on by the step's draw (the draw comes before the step: ``before_step``), so the next
    steps draw other classes than the twin's; a batch refused at once (bad ids with
    ``sync_every=1``) moves nothing, the generator included."""
    head = deferred(sync_every=sync_every, loss="sampled", loss_kwargs=None, negatives={"num": 5, "seed": 7})
    H, idx = batch(5, d, D, 2)
    step(head, H, idx)
    twin = copy.deepcopy(head)
    H_bad, idx_bad = void_batch(H, idx, bad)
    refused = bad == "ids" and sync_every == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skip's warning (its own test above)
        try:
            step(head, H_bad, idx_bad)
            head.sync()
        except ValueError:
            assert bad == "ids"
        twin.sync()
    a, b = head.state_dict(), twin.state_dict()
    changed = {k for k in a if isinstance(a[k], torch.Tensor) and not torch.equal(a[k], b[k])}
    assert changed == (set() if refused else {"skipped_nonfinite"})
    assert torch.equal(head.negatives.generator.get_state(), twin.negatives.generator.get_state()) == refused


@pytest.mark.parametrize("bad", ["ids", "nan", "inf"])
def test_a_void_step_leaves_a_state_that_saves_and_loads(bad):
    """Between two reads, a void step leaves the adaptive rule's rho bound as its twin's (a
    non-finite batch's own bound is nan, a bad-id batch's any value), so a checkpoint taken
    before the next read loads, with the twin's state."""
    kw = dict(sync_every=4, stabiliser={"inverse": "products", "neumann": "adaptive"})
    torch.manual_seed(0)
    head = deferred(**kw)
    H, idx = batch(5, d, D, 2)
    step(head, H, idx)
    twin = copy.deepcopy(head)
    head.lr = 10 * twin.lr  # a step whose rho bound, were it kept, would pass the twin's (bad ids)
    step(head, *void_batch(H, idx, bad))
    head.lr = twin.lr
    saved = head.state_dict()
    assert torch.equal(saved["_extra_state"]["rho_max"], twin.state_dict()["_extra_state"]["rho_max"])
    resumed = deferred(**kw)
    resumed.load_state_dict(saved)
    assert state(resumed) == state(head) == state(twin)


#: reads every 4 steps, a check at step 9, the products route with the adaptive Neumann rule
ADAPTIVE = dict(sync_every=4, stabiliser={"inverse": "products", "check_every": 9, "neumann": "adaptive"})


def run(head, batches):
    for H, idx in batches:
        step(head, H, idx)


def test_a_run_resumed_between_two_reads_goes_on_bit_for_bit():
    """Saved after step 9, the flags last read at step 8 (``sync_every=4``): the resumed run's next
    read (step 12) runs the check that fell due at step 9 (``check_every=9``) and chooses the
    products route's Neumann factors from the rho bound of steps 9 to 12, as the saved run's read
    does; the state keeps the last read's step and that bound (``flags_read_at``, ``rho_max``)."""
    kw = ADAPTIVE
    torch.manual_seed(0)
    batches = [batch(5, d, D, 2) for _ in range(20)]
    a = deferred(**kw)
    run(a, batches[:9])
    saved = copy.deepcopy(a.state_dict())
    assert saved["_extra_state"]["flags_read_at"] == [8, 0] and "rho_max" in saved["_extra_state"]
    b = deferred(**kw)
    b.load_state_dict(saved)
    run(a, batches[9:])
    run(b, batches[9:])
    assert int(a.checks) == int(b.checks) >= 2
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    for key, bad in (("flags_read_at", [8]), ("rho_max", torch.tensor(float("nan"))),
                     ("loss_factor", torch.tensor(float("nan"), dtype=torch.float64))):
        c = deferred(**kw)
        before = state_of(c)
        with pytest.raises(ValueError, match=key) as err:
            c.load_state_dict({**saved, "_extra_state": {**saved["_extra_state"], key: bad}})
        assert "\n" not in str(err.value)
        assert_untouched(c, before)


@pytest.mark.parametrize("loss", ["zloss", "sampled"])  # sampled: its draws and P, lst-train's head
@pytest.mark.parametrize("saved_at", [0, 9])
def test_a_head_that_ran_before_it_loads_a_state_goes_on_as_a_new_head_loading_it(saved_at, loss):
    """A load in the same process (Lightning's tuners restore the model, the HF Trainer loads the
    best model): the host's side of the flags is the state's, not what the head ran before.
    Otherwise the next read is skipped where the steps run since the load reach the count of the
    last read before it (saved at step 9), and the adaptive rule starts from the old rho bound (a
    state saved before any step holds none)."""
    kw = ADAPTIVE if loss == "zloss" else {**ADAPTIVE, "loss": loss, "loss_kwargs": {}, "negatives": {},
                                           "preconditioner": {}}
    torch.manual_seed(0)
    batches = [batch(5, d, D, 2) for _ in range(30)]
    a = deferred(**kw)
    run(a, batches[:saved_at])
    saved = copy.deepcopy(a.state_dict())
    new, ran = deferred(**kw), deferred(**kw)
    ran.lr = 5 * ran.lr  # larger rho bounds than the loaded run's (the state sets its own lr)
    run(ran, batches[17:30])  # 13 steps: the flags read at 12, the rho bound of step 13 kept
    for head in (new, ran):
        head.load_state_dict(saved)
        run(head, batches[saved_at:saved_at + 16])
    assert int(new.checks) == int(ran.checks) >= 1
    sn, sr = state_of(new), state_of(ran)
    assert all(torch.equal(sn[k], sr[k]) for k in sn)


def test_a_loss_factor_not_yet_read_is_the_states():
    """A loss that reached the head halved (accumulation, not attached) is warned at the flags' next
    read: by a head that loads a state saved before that read, and not by a head that recorded one
    and then loads a state without (Lightning's tuner runs steps, then restores the state it saved)."""
    clean = deferred(sync_every=10)
    H, idx = batch(5, d, D, 2)
    halved = copy.deepcopy(clean)
    (halved(H.clone().requires_grad_(), idx) * 0.5).backward()
    for head, saved, warns in ((deferred(sync_every=10), halved.state_dict(), True),
                               (halved, clean.state_dict(), False)):
        head.load_state_dict(saved)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            head.sync()
        assert any("multiplied by 0.5" in str(w.message) for w in caught) == warns


def test_the_flags_rho_bound_follows_the_heads_moves():
    """The adaptive rule's rho bound since the last read (a device scalar of the flags, not a buffer;
    in the state) moves with the head: loaded on the CPU, then moved (here to the meta device; on a
    GPU: tests/spherical/test_cuda.py); out of the meta device (``to_empty``) it starts at 0."""
    a = deferred(**ADAPTIVE)
    run(a, [batch(5, d, D, 2) for _ in range(3)])
    b = deferred(**ADAPTIVE)
    b.load_state_dict(a.state_dict())
    assert b.step_checks.rho_max.device.type == "cpu" and b.step_checks.rho_max > 0
    b.to("meta")
    assert b.step_checks.rho_max.is_meta
    b.to_empty(device="cpu")
    assert b.step_checks.rho_max.device.type == "cpu" and b.step_checks.rho_max == 0
    assert b.step_checks.rho_max.dtype == b.cond_bound.dtype


def test_repairs_fall_due_at_the_reads():
    """Periodic repairs still run when their step falls between two reads."""
    head = deferred(sync_every=3, stabiliser={"check_every": 5, "q_refresh_every": 7})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(15):
            H, idx = batch(4, d, D, 2)
            head(H.requires_grad_(), idx).backward()
    assert int(head.checks) >= 3 and int(head.q_refreshes) == 2  # steps 5, 10, 15; 7, 14
    W = head.weight()
    torch.testing.assert_close(head.Q, W.T @ W)


def test_naive_head_has_no_deferred_mode():
    n = NaiveSphericalHead(num_classes=D, hidden_dim=d)
    assert n.deferred_checks is False
    with pytest.raises(ValueError, match="sync_every"):
        deferred(sync_every=0)












def test_a_report_read_changes_nothing_the_steps_depend_on():
    """``sync(repair=False)`` (the end of training's read): it reports a bad batch, but runs no
    repair and keeps the read's window and the Neumann factors, so a head read so mid-run steps
    bit for bit as one that was not (a run's state never depends on where it stopped)."""
    torch.manual_seed(3)
    kw = dict(sync_every=4, stabiliser={"check_every": 3, "inverse": "products"}, lr=0.3)
    a, b = deferred(**kw), deferred(**kw)
    b.load_state_dict(a.state_dict())
    batches = [batch(6, d, D, 3) for _ in range(9)]
    for i, (H, idx) in enumerate(batches):
        for head in (a, b):
            step(head, H, idx)
        if i in (1, 5):
            b.sync(repair=False)
    assert state(a) == state(b) and a.step_checks.factors == b.step_checks.factors
    assert int(a.checks) == int(b.checks) >= 1  # the repairs ran at the regular reads only
    H, idx = batches[0]
    bad = idx.clone()
    bad[0, 0] = D
    step(b, H, bad)
    with pytest.raises(ValueError, match="the batch of step 10 had target ids outside"):
        b.sync(repair=False)


def test_stats_without_a_read_are_the_counters_the_flags_last_read(monkeypatch):
    """``logged_stats()`` under device flags reads nothing on the device: the counters as the
    flags' last read took them, in that read's one transfer ({} before the first read)."""
    f = deferred(sync_every=4)
    assert f.logged_stats() == {}
    for n in range(1, 11):
        H, idx = batch(3, d, D, 2)
        step(f, H, idx)
        if n % 4 == 0:
            at_read = f.stats()  # nothing ran since the read: these are the counters it saw
        with no_host_reads(monkeypatch):
            kept = f.logged_stats()
        assert kept == ({} if n < 4 else at_read), n
    assert kept["steps"] == 8 and f.stats()["steps"] == 10


def test_a_party_on_the_flag_board_is_read_with_the_flags_on_their_schedule():
    """A training loop's device flags registered on ``head.flag_board`` ride on the head's read,
    in its one transfer, every ``sync_every`` steps: a fault noted at step 1 raises at the read
    of step 3 (the 4th step), not before; one noted after the last read is read by the end of
    training's ``sync(repair=False)`` with no step since."""
    head, fault, seen = deferred(sync_every=4), FirstFault(), []

    def on_read(values):
        seen.append(len(values))
        got = FirstFault.of(values)
        if got is not None:
            raise ValueError(f"a fault at step {got[0]}")

    head.flag_board.register("loop", fault.values, on_read)
    H, idx = batch(5, d, D, 3)
    for s in range(3):
        step(head, H, idx)
        fault.note(torch.tensor(s == 1), s)
    assert seen == []
    with HostReads() as reads, pytest.raises(ValueError, match="a fault at step 1"):
        step(head, H, idx)  # the 4th step reads the flags, the party's with them
    assert seen == [4] and sum(n for site, n in reads.sites.items() if "flag_board" in site) == 1, reads.sites
    late = FirstFault()
    head.flag_board.register("loop", late.values, on_read)
    for s in range(4, 8):
        step(head, H, idx)  # read at the 8th step: nothing noted yet
    late.note(torch.tensor(True), 7)
    with pytest.raises(ValueError, match="a fault at step 7"):
        head.sync(repair=False)
