"""Batches for the row-sparse optimisers' tests: random ids with repeats and padding, and their rows' gradients."""
from host_reads import HostReads
import torch
from torch import nn

from lst_lightning.rows import RowGrad, row_grad_of


def steps_of(D: int, e: int, n: int, steps: int, dtype, g: torch.Generator):
    """``steps`` batches of n ids in [-1, D / 2) (repeats, and padding -1) and their rows' gradients."""
    out = []
    for _ in range(steps):
        ids = torch.randint(-1, D // 2, (n,), generator=g)
        out.append((ids, torch.randn(n, e, generator=g, dtype=dtype)))
    return out


def table_and_steps(dtype, D: int = 40, e: int = 5, n: int = 33, steps: int = 6, seed: int = 7):
    """A random D x e table and ``steps_of``'s batches for it, from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(D, e, generator=g, dtype=dtype)
    return table, steps_of(D, e, n, steps, dtype, g)


def step_sparse(p: nn.Parameter, opt, batches) -> None:
    """``opt``'s steps of ``p`` (torch's optimiser, the reference), each gradient torch's sparse COO
    tensor of the real ids' rows (uncoalesced), as ``nn.Embedding(sparse=True)`` gives it."""
    for ids, rows in batches:
        keep = ids >= 0
        p.grad = torch.sparse_coo_tensor(ids[keep][None], rows[keep], p.shape, check_invariants=True)
        opt.step()
        opt.zero_grad()


def host_reads_of_a_step(make_optimizer, table: torch.Tensor, ids: torch.Tensor) -> HostReads:
    """The host reads of one step of ``make_optimizer([p])`` on a copy of ``table`` with static rows,
    after a backward through a gather of ``ids``."""
    p = nn.Parameter(table.clone())
    rg, opt = RowGrad(p), make_optimizer([p])
    rg.gather(p, ids).sum().backward()
    with HostReads() as reads:
        opt.step()
    return reads


def step_rows(p: nn.Parameter, opt, batches) -> None:
    """``opt``'s steps of ``p`` (a table with static rows), each the gradient ``rows`` of the ``ids`` gathered."""
    rg = row_grad_of(p)
    for ids, rows in batches:
        (rg.gather(p, ids) * rows).sum().backward()  # the gradient of the gathered rows is `rows`
        opt.step()
        opt.zero_grad()
