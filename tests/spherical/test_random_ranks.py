"""The factored head on two processes in settings drawn at random (helpers/random_ranks.py), float64:
W equals one process's on the global batch after every case's steps, and replicas are equal."""
import pytest
import torch
from forked_ranks import start_ranks

from made_once import made_once
from random_ranks import WORLD, case, make_head, train, worker

CASES = 24


def run_ranks(folder) -> None:
    start_ranks(worker, (str(folder / "rdv"), str(folder), list(range(CASES))), WORLD)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = made_once(tmp_path_factory, "random_ranks", run_ranks)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("seed", range(CASES))
def test_two_ranks_equal_one_process_in_settings_drawn_at_random(ranks, seed):
    kw, parallel, driver, _ = case(seed)
    single = train(make_head(kw, "none", seed), seed, None)
    assert float((single - make_head(kw, "none", seed).weight()).norm() / single.norm()) > 1e-4  # the steps moved W
    got = [r[seed] for r in ranks]
    W = torch.cat(got) if parallel == "sharded" else got[0]
    assert float((W - single).norm() / single.norm()) < 1e-10, (kw, parallel, driver)
    if parallel == "replicated":
        assert torch.equal(got[0], got[1])


def test_the_cases_cover_every_driver_both_parallels_and_both_kinds_of_negatives():
    drawn = {(case(s)[1], case(s)[2]) for s in range(CASES)}
    assert drawn == {(p, d) for p in ("replicated", "sharded") for d in ("autograd", "fused", "accumulated")}
    kinds = {(case(s)[0]["negatives"] or {}).get("shared") for s in range(CASES)}
    assert kinds == {None, True, False}
