"""RowAdam against torch's SparseAdam, the obviously-correct reference: the same rows (fresh
random ids with repeats and padding), the same gradients, several steps; eager, and compiled
(aot_eager), whose update takes no host read."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lst_lightning.rows import RowAdam, RowGrad, coalesce_rows

from row_batches import host_reads_of_a_step, step_rows, step_sparse, table_and_steps


def sparse_adam_reference(table: torch.Tensor, batches, lr: float, betas, eps):
    """torch.optim.SparseAdam, each step's gradient a COO tensor of the real ids' rows (uncoalesced)."""
    p = nn.Parameter(table.clone())
    opt = torch.optim.SparseAdam([p], lr=lr, betas=betas, eps=eps)
    step_sparse(p, opt, batches)
    return p.detach(), opt.state[p]


def row_adam_run(table: torch.Tensor, batches, lr: float, betas, eps, compiled: bool = False):
    p = nn.Parameter(table.clone())
    RowGrad(p)
    opt = RowAdam([p], lr=lr, betas=betas, eps=eps, compiled=compiled, mode=None)
    if compiled:
        import lst_lightning.rows.adam as adam  # noqa: PLC0415

        adam._compiled[None] = torch.compile(adam.row_adam_, fullgraph=True, dynamic=False, backend="aot_eager")
    step_rows(p, opt, batches)
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_row_adam_equals_sparse_adam_on_the_same_rows(dtype, tol):
    table, batches = table_and_steps(dtype)
    D = table.shape[0]
    lr, betas, eps = 0.05, (0.8, 0.95), 1e-6
    want, ref_state = sparse_adam_reference(table, batches, lr, betas, eps)
    got, state = row_adam_run(table, batches, lr, betas, eps)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=tol, atol=tol)
    torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=tol, atol=tol)
    assert int(state["step"]) == ref_state["step"] == len(batches)
    untouched = torch.ones(D, dtype=torch.bool)
    untouched[torch.cat([ids[ids >= 0] for ids, _ in batches])] = False
    assert untouched.any() and torch.equal(got[untouched], table[untouched])  # lazy: other rows keep their values


def test_a_step_of_padding_only_changes_nothing_but_the_count():
    p = nn.Parameter(torch.randn(6, 3))
    rg, before = RowGrad(p), p.detach().clone()
    opt = RowAdam([p], lr=0.1)
    rg.gather(p, torch.full((4,), -1)).sum().backward()
    opt.step()
    assert torch.equal(p.detach(), before) and int(opt.state[p]["step"]) == 1
    assert not opt.state[p]["exp_avg"].any()


def test_compiled_row_adam_equals_the_eager_one_and_reads_nothing_on_the_host():
    table, batches = table_and_steps(torch.float32, D=30, e=4, n=17, steps=4, seed=3)
    want, _ = row_adam_run(table, batches, 0.02, (0.9, 0.999), 1e-8)
    got, _ = row_adam_run(table, batches, 0.02, (0.9, 0.999), 1e-8, compiled=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    reads = host_reads_of_a_step(lambda params: RowAdam(params, lr=0.02), table, batches[0][0])
    assert reads.count == 0, reads.sites


def test_coalesce_rows_equals_torch_coalesce():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, 9, (50,), generator=g)
    rows = torch.randn(50, 3, generator=g, dtype=torch.float64)
    uids, summed = coalesce_rows(ids, rows)
    keep = ids >= 0
    ref = torch.sparse_coo_tensor(ids[keep][None], rows[keep], (9, 3)).coalesce()
    real = uids >= 0
    assert torch.equal(uids[real], ref.indices()[0])
    torch.testing.assert_close(summed[real], ref.values(), rtol=1e-14, atol=1e-14)
    n_runs = int(real.sum()) + int((ids < 0).any())
    assert not summed[n_runs:].any() and (uids[n_runs:] == -1).all()  # the slots no id fills


def test_row_adam_refuses_a_parameter_without_static_rows():
    with pytest.raises(ValueError, match="static rows"):
        RowAdam([nn.Parameter(torch.zeros(3, 2))])
