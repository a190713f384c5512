"""RowGrad's gather and static_rows: the rows' gradient equals the dense gradient of the table
(fresh random ids with repeats and padding), a RowEmbedding gives what nn.Embedding gives, and
static_rows keeps the parameter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lst_lightning.rows import RowEmbedding, RowGrad, coalesce_rows, row_grad_of, static_rows


def dense_from_rows(rg: RowGrad, D: int) -> torch.Tensor:
    ids, rows = rg.grad()
    uids, summed = coalesce_rows(ids, rows)
    out = torch.zeros(D, *rows.shape[1:], dtype=rows.dtype)
    real = uids >= 0
    out[uids[real]] = summed[real]
    return out


def test_the_rows_gradient_is_the_dense_gradient_of_the_table():
    g = torch.Generator().manual_seed(5)
    D, e = 12, 3
    table = nn.Parameter(torch.randn(D, e, generator=g, dtype=torch.float64))
    rg = RowGrad(table)
    ids = torch.randint(-1, D, (4, 7), generator=g)
    w = torch.randn(4, 7, e, generator=g, dtype=torch.float64)
    out = rg.gather(table, ids)
    assert out.shape == (4, 7, e) and table.grad is None
    (out * w).sum().backward()
    assert table.grad is None and rg.capacity == 28
    ref = torch.zeros(D, e, dtype=torch.float64).index_add_(0, ids[ids >= 0], w[ids >= 0])
    torch.testing.assert_close(dense_from_rows(rg, D), ref, rtol=1e-14, atol=1e-14)


def test_a_smaller_batch_fits_the_capacity_and_pads_its_ids():
    table = nn.Parameter(torch.randn(10, 2))
    rg = RowGrad(table, capacity=6)
    rg.gather(table, torch.tensor([3, 3, 1])).sum().backward()
    ids, rows = rg.grad()
    assert ids.tolist() == [3, 3, 1, -1, -1, -1] and not rows[3:].any() and rows[:3].eq(1).all()


def test_a_row_embedding_is_an_embedding_and_static_rows_keeps_the_weight():
    emb = nn.Embedding(20, 4, sparse=True)
    body = nn.Sequential(emb, nn.Flatten(), nn.Linear(12, 2))
    weight = emb.weight
    ids = torch.randint(0, 20, (5, 3))
    want = body(ids)
    found = static_rows(body)
    assert isinstance(body[0], RowEmbedding) and body[0].weight is weight and row_grad_of(weight) is found[0]
    torch.testing.assert_close(body(ids), want, rtol=0, atol=0)
    assert static_rows(body) == found  # idempotent


def test_static_rows_refuses_a_table_of_another_module():
    with pytest.raises(ValueError, match="not a parameter"):
        static_rows(nn.Linear(2, 2), [nn.Parameter(torch.zeros(3, 2))])


def test_the_rows_follow_the_module_to_another_dtype():
    emb = RowEmbedding(8, 2)
    emb.double()
    assert emb.row_grad.rows.dtype == torch.float64 and emb.row_grad.rows.is_leaf
    emb(torch.tensor([[1, 2]])).sum().backward()
    assert emb.row_grad.grad()[1].dtype == torch.float64
