"""Driving: how the factored head's step is driven:'s step, sync_every and parallel, ruled on together once."""
import pytest

from lst_lightning.spherical.driving import Driving

from head_pairs import D, batch, deferred, make_pair


@pytest.mark.parametrize("kw,match", [
    ({"step": "eager"}, "step must be one of"),
    ({"sync_every": 0}, "sync_every must be an int >= 1"),
    ({"sync_every": True}, "sync_every must be an int >= 1"),
    ({"parallel": "both"}, "parallel must be"),
    ({"step": "cuda_graph", "sync_every": 1}, r"needs sync_every > 1"),
    ({"compile": "yes"}, "compile must be one of"),
    ({"compile": 1}, "compile must be one of"),
    ({"step": "cuda_graph", "sync_every": 4, "parallel": "sharded"}, "not captured"),
])
def test_bad_combinations_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Driving(**kw)


def test_what_can_accumulate():
    assert Driving().cannot_accumulate() is None  # device flags accumulate, as host checks do
    assert Driving(sync_every=1).cannot_accumulate() is None
    assert "step='fused'" in Driving("fused").cannot_accumulate()
    assert Driving(parallel="replicated").cannot_accumulate() is None  # accumulates across processes
    assert Driving().deferred_checks and not Driving(sync_every=1).deferred_checks


def test_the_head_checks_its_mode_at_construction_and_on_change():
    with pytest.raises(ValueError, match=r"needs sync_every > 1"):
        deferred(sync_every=1, step="cuda_graph")
    head = deferred(sync_every=1)
    with pytest.raises(ValueError, match=r"needs sync_every > 1"):
        head.step = "cuda_graph"
    assert head.step == "autograd" and head.driving == Driving("autograd", 1, "none")  # unchanged
    head.sync_every = 3
    head.step = "cuda_graph"
    with pytest.raises(ValueError, match=r"needs sync_every > 1"):
        head.sync_every = 1
    assert (head.step, head.sync_every, head.deferred_checks) == ("cuda_graph", 3, True)
    assert "step='cuda_graph'" in head.cannot_accumulate()


def test_the_naive_head_always_accumulates():
    _, naive = make_pair("zloss")
    assert naive.cannot_accumulate() is None and naive.step == "autograd"


def test_one_board_of_flags_read_every_sync_every_steps_and_after_each_with_1():
    """One board of device flags whatever sync_every: sync_every=1 reads it after every step, the
    same device part's flags; a change of sync_every keeps it, its counts and its Neumann factors."""
    from lst_lightning.spherical.driver import DeviceFlags

    head = deferred(sync_every=1)
    assert type(head.step_checks) is DeviceFlags and not head.deferred_checks
    H, idx = batch(4, 8, D, 2)
    head(H.clone().requires_grad_(), idx).backward()
    board = head.step_checks
    assert board.calls == board.read_at == 1 and board.synced == (1, 0) and board.stats["steps"] == 1
    head.sync_every = 3
    assert head.step_checks is board and head.deferred_checks
    assert (board.calls, board.synced) == (1, (1, 0))
    head.sync_every = 5
    head.sync_every = 1
    assert head.step_checks is board


def test_the_old_names_of_the_mode_and_the_checks_warn():
    head = deferred(sync_every=3)
    with pytest.warns(DeprecationWarning, match="head.driving"):
        assert head.mode is head.driving
    with pytest.warns(DeprecationWarning, match="head.step_checks"):
        assert head.checker is head.step_checks
