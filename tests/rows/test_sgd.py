"""RowSGD against torch's SGD on a sparse COO gradient, the obviously-correct reference: the same
rows (fresh random ids with repeats and padding), the same gradients, several steps; eager, and
compiled (aot_eager), whose update takes no host read."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import lst_lightning.rows.sgd as sgd
from lst_lightning.rows import RowGrad, RowSGD

from row_batches import host_reads_of_a_step, step_rows, step_sparse, table_and_steps


def sparse_sgd_reference(table: torch.Tensor, batches, lr: float) -> torch.Tensor:
    p = nn.Parameter(table.clone())
    step_sparse(p, torch.optim.SGD([p], lr=lr), batches)
    return p.detach()


def row_sgd_run(table: torch.Tensor, batches, lr: float, compiled: bool = False) -> torch.Tensor:
    p = nn.Parameter(table.clone())
    RowGrad(p)
    step_rows(p, RowSGD([p], lr=lr, compiled=compiled), batches)
    return p.detach()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_row_sgd_equals_torch_sgd_on_the_same_sparse_rows(dtype, tol):
    table, batches = table_and_steps(dtype)
    D = table.shape[0]
    want = sparse_sgd_reference(table, batches, 0.3)
    got = row_sgd_run(table, batches, 0.3)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    untouched = torch.ones(D, dtype=torch.bool)
    untouched[torch.cat([ids[ids >= 0] for ids, _ in batches])] = False
    assert untouched.any() and torch.equal(got[untouched], table[untouched])


def test_a_step_of_padding_only_changes_nothing():
    p = nn.Parameter(torch.randn(6, 3))
    rg, before = RowGrad(p), p.detach().clone()
    opt = RowSGD([p], lr=0.1)
    rg.gather(p, torch.full((4,), -1)).sum().backward()
    opt.step()
    assert torch.equal(p.detach(), before)


def test_compiled_row_sgd_equals_the_eager_one_and_reads_nothing_on_the_host(monkeypatch):
    monkeypatch.setattr(sgd, "_compiled", {None: torch.compile(sgd.row_sgd_, fullgraph=True, dynamic=False,
                                                                 backend="aot_eager")})
    table, batches = table_and_steps(torch.float32, D=30, e=4, n=17, steps=4, seed=3)
    want = row_sgd_run(table, batches, 0.2)
    got = row_sgd_run(table, batches, 0.2, compiled=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    reads = host_reads_of_a_step(lambda params: RowSGD(params, lr=0.02), table, batches[0][0])
    assert reads.count == 0, reads.sites


def test_row_sgd_refuses_a_parameter_without_static_rows_and_a_bad_lr():
    with pytest.raises(ValueError, match="RowSGD steps tables with static rows"):
        RowSGD([nn.Parameter(torch.zeros(3, 2))])
    p = nn.Parameter(torch.zeros(3, 2))
    RowGrad(p)
    with pytest.raises(ValueError, match="RowSGD: lr must be > 0"):
        RowSGD([p], lr=0.0)
