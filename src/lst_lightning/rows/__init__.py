"""Row-sparse tables in static shapes: the rows of a D x e table (an input embedding, a head's
class rows) that a training step gathers, their gradient as (ids, rows) of a fixed size, and
Adam or SGD over exactly those rows. ``torch.compile`` takes the gather, its backward and the update
whole, and a CUDA graph can capture them: nothing in them has a size only the data knows
(torch's sparse COO gradients, whose coalesced size changes each step, have). Imports torch
only (docs/architecture.md).

- ``gathered.py``: ``RowGrad`` (the ids and the rows' gradient of one table) and its gather;
- ``coalesce.py``: ``coalesce_rows``, repeated ids summed by a sort of fixed size;
- ``adam.py``: ``RowAdam``, torch's ``SparseAdam`` arithmetic on those rows;
- ``sgd.py``: ``RowSGD``, torch's SGD on a sparse gradient, on those rows;
- ``row_optimizer.py``: ``RowOptimizer``, what the two share;
- ``embedding.py``: ``RowEmbedding`` (an ``nn.Embedding`` with static rows) and ``static_rows``,
  which gives a model's row-sparse tables static rows.
"""
from .adam import RowAdam
from .coalesce import coalesce_rows
from .embedding import RowEmbedding, static_rows
from .gathered import RowGrad, row_grad_of
from .sgd import RowSGD

__all__ = ["RowAdam", "RowEmbedding", "RowGrad", "RowSGD", "coalesce_rows", "row_grad_of", "static_rows"]
