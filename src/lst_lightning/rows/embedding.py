"""``RowEmbedding``: an ``nn.Embedding`` whose training gradient is the rows its batch read, in
static shapes (a ``RowGrad``), and ``static_rows``, which gives a model's row-sparse tables
static rows: each ``nn.Embedding(sparse=True)`` becomes a ``RowEmbedding`` on the same weight, and
each table named (a head's ``sparse_parameters()``) gets a ``RowGrad``, through which its owner's
gathers then go."""
from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from .gathered import RowGrad, row_grad_of


class RowEmbedding(nn.Embedding):
    """``nn.Embedding`` (no ``padding_idx``, ``max_norm``) with static rows: in training its
    weight gets no ``.grad``, the batch's rows' gradient goes to ``row_grad`` (``RowAdam`` steps them)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, **kwargs):
        if kwargs.get("padding_idx") is not None or kwargs.get("max_norm") is not None or kwargs.get("sparse"):
            raise ValueError("RowEmbedding takes no padding_idx, max_norm or sparse (its rows are row-sparse already)")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.row_grad = RowGrad(self.weight)

    @classmethod
    def of(cls, embedding: nn.Embedding) -> "RowEmbedding":
        """A ``RowEmbedding`` on ``embedding``'s own weight (the same parameter, not a copy)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("an nn.Embedding with padding_idx or max_norm cannot take static rows")
        out = cls(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight.detach())
        out.weight = embedding.weight
        out.row_grad = RowGrad(out.weight)
        return out

    def forward(self, ids: Tensor) -> Tensor:
        return self.row_grad.gather(self.weight, ids)


def static_rows(module: nn.Module, tables: Iterable[nn.Parameter] = ()) -> list[RowGrad]:
    """Static rows for ``module``: each ``nn.Embedding(sparse=True)`` in it replaced by a
    ``RowEmbedding`` on the same weight, and a ``RowGrad`` for each of ``tables`` (parameters of
    ``module`` whose gathers go through ``row_grad_of``: the baselines' ``row_gather``), registered
    in ``module`` so that it follows the module's device and dtype. Returns every ``RowGrad`` of
    ``module``. Idempotent."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding) and not isinstance(child, RowEmbedding) and child.sparse:
                setattr(parent, name, RowEmbedding.of(child))
    names = {id(p): n for n, p in module.named_parameters()}
    for table in tables:
        if id(table) not in names:
            raise ValueError(f"static_rows: a table of shape {tuple(table.shape)} is not a parameter of the module")
        if row_grad_of(table) is None:
            module.add_module("row_grad_" + names[id(table)].replace(".", "_"), RowGrad(table))
    return [m for m in module.modules() if isinstance(m, RowGrad)]
