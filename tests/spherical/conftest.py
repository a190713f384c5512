"""The two-rank run and its one-process reference, made once per session: they spawn processes."""
import pytest
import torch
import torch.multiprocessing as mp

from two_ranks import ROWS, WORLD, evaluate, make_head, negatives, train, train_on_unions, worker


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(worker, args=(str(tmp / "rdv"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="session")
def single():
    """One process, the global batches."""
    head = make_head("none")
    all_rows = slice(0, sum(ROWS))
    grads = train(head, all_rows)
    unions = make_head("none")
    train_on_unions(unions)
    out = {"grads": grads, "W": head.weight(), "eval": evaluate(head, all_rows), "W_unions": unions.weight()}
    for shared in (True, False):
        sampled = make_head("none", **negatives(shared))
        out[f"negatives_shared={shared}"] = {"grads": train(sampled, all_rows), "W": sampled.weight()}
    return out
