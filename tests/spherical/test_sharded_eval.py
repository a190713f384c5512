"""Evaluation of a sharded head (sharded_eval.py): every rank's ranks, top-k lists and
log-probabilities equal one process's."""
import math

import pytest
import torch

from two_ranks import ROWS, d, eval_batch, make_head, train


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_evaluation_merges_shards(ranks, single, mode):
    ref = single["eval"]
    for r, res in enumerate(ranks):
        lo, hi = sum(ROWS[:r]), sum(ROWS[: r + 1])
        got = res[mode]["eval"]
        assert torch.equal(got["rank"], ref["rank"][lo:hi])
        assert torch.equal(got["topk"][1], ref["topk"][1][lo:hi])
        assert torch.allclose(got["topk"][0], ref["topk"][0][lo:hi], rtol=1e-12, atol=0)
        assert torch.allclose(got["log_prob"], ref["log_prob"][lo:hi], rtol=1e-12, atol=0)
    # the eval loss of each rank is the mean over its own rows
    H, t = eval_batch()
    head = make_head("none")
    train(head, slice(0, sum(ROWS)))
    head.eval()
    assert math.isclose(float(ranks[1][mode]["eval"]["loss"]), float(head(H[5:], t[5:])), rel_tol=1e-12)



def test_topk_over_chunks_equals_full_topk():
    head = make_head("none")
    H = torch.randn(6, d, dtype=torch.float64)
    best, ids = head.topk(H, 7, chunk_size=8)  # chunks smaller than k
    want = head.scores(H).topk(7, dim=1)
    assert torch.equal(ids, want.indices)
    assert torch.allclose(best, want.values, rtol=1e-12, atol=0)  # GEMMs of other widths round apart
