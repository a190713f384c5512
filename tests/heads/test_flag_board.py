"""``FlagBoard``: the owner's device flags and every party's read in one host transfer, each
party's values handed to it in the order registered, a party's raise ending the read."""
import pytest
import torch

from lst_lightning.heads.flag_board import FlagBoard

from host_reads import HostReads


def test_the_owner_and_every_party_are_read_in_one_transfer():
    board, got = FlagBoard(), []
    board.register("a", lambda: [torch.tensor(2), torch.tensor(3.5)], lambda v: got.append(("a", v)))
    board.register("none yet", lambda: [], lambda v: got.append(("none yet", v)))
    board.register("b", lambda: [torch.tensor(True)], lambda v: got.append(("b", v)))
    with HostReads() as reads:
        own = board.read([torch.tensor(7, dtype=torch.int64), torch.tensor(0.25, dtype=torch.float64)])
    assert reads.count == 1, reads.sites
    assert own == [7.0, 0.25]
    assert got == [("a", [2.0, 3.5]), ("none yet", []), ("b", [1.0])]


def test_a_name_registered_again_replaces_its_party_and_nothing_to_read_reads_nothing():
    board, got = FlagBoard(), []
    board.register("a", lambda: [torch.tensor(1)], lambda v: got.append(1))
    board.register("a", lambda: [], lambda v: got.append(2))
    with HostReads() as reads:
        assert board.read() == []
    assert reads.count == 0 and got == []


def test_a_party_raises_for_its_fault():
    board = FlagBoard()

    def refuse(values):
        if values[0]:
            raise ValueError(f"fault at step {int(values[0])}")

    board.register("party", lambda: [torch.tensor(5)], refuse)
    with pytest.raises(ValueError, match="fault at step 5"):
        board.read([torch.tensor(1.0)])
