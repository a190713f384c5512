"""``LossChecks``, the app's device flags where the head has no deferred checks (an ordinary head's
loss and the flags its other parties register on its board, read together every ``check_every``
steps), and ``LanguageModel.flag_board``: the head's board where the head has deferred checks.
The loss's own schedule and message: tests/app/test_compiling.py; the exchange's fault on the
head's read, on two ranks: tests/app/test_sparse_exchange.py."""
import pytest
import torch

from lst_lightning.app.callbacks import HeadSteps, SparseGradients
from lst_lightning.app.loss_checks import LossChecks
from lst_lightning.app.module import LanguageModel
from lst_lightning.baselines import HierarchicalSoftmaxHead
from lst_lightning.models import NgramMLP
from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.distributed.fixed_exchange import FirstFault

from host_reads import HostReads


def test_a_baseline_head_s_board_carries_the_loss_and_the_other_parties_in_one_transfer():
    checks, fault, seen = LossChecks(check_every=4), FirstFault(), []
    checks.board.register("exchange", fault.values, lambda values: seen.append(FirstFault.of(values)))
    with HostReads() as reads:
        for step in range(3):
            checks.record(torch.tensor(1.0), step)
            fault.note(torch.tensor(step == 1), step, count=9)
    assert reads.count == 0 and seen == []
    with HostReads() as reads:
        checks.record(torch.tensor(1.0), 3)  # due: the loss and the party, one transfer
    assert reads.count == 1 and seen == [(1, 0, 0, 9)], reads.sites
    for step in range(4, 8):
        checks.record(None, step)  # a self-updating head's: no loss noted, the board still read
    assert seen == [(1, 0, 0, 9)] * 2
    checks.record(torch.tensor(float("nan")), 8)
    with pytest.raises(FloatingPointError, match="non-finite training loss at step 8 .read at step 9"):
        checks.read(9)  # the loss first, in the order registered
    assert len(seen) == 2


def _body():
    return NgramMLP(20, 2, 4, [4], 4, sparse_embedding=True)


def test_the_app_s_flags_ride_on_the_head_s_board_where_it_has_deferred_checks():
    head = FactoredSphericalHead(30, 4, sync_every=4)
    m = LanguageModel(_body(), head, optimizer={"embedding": "row_adam"})
    assert m.flag_board is head.flag_board
    made = m.configure_callbacks()
    assert [type(c) for c in made] == [HeadSteps, SparseGradients]
    assert made[1].board is head.flag_board and not made[1].reads  # the head reads it, every 4 steps
    head.sync_every = 1  # no deferred checks: the app's own board, every check_every steps
    assert m.flag_board is m.loss_checks.board
    baseline = LanguageModel(_body(), HierarchicalSoftmaxHead(num_classes=30, hidden_dim=4, class_counts=torch.ones(30)),
                             optimizer={"embedding": "sparse_sgd"})
    assert baseline.flag_board is baseline.loss_checks.board
    assert baseline.configure_callbacks()[0].board is baseline.loss_checks.board
    assert SparseGradients().reads  # a callback of the caller's reads a board of its own
