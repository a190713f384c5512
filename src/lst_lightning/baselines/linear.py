"""Shared part of the heads whose class scores are a linear map ``o = W h + b``
(full softmax, sampled softmax): parameters, full scores in chunks, exact
log-probabilities for perplexity.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads.base import OutputHead
from ..heads.targets import check_hidden, check_reduction, check_targets, class_range, in_head_dtype


class LinearClassHead(OutputHead):
    """``W`` (D, d) and optional bias ``b`` (D), trained by the optimizer.

    ``cosine_scale`` (tau): when set, the logits are ``tau cos(h, w_i)`` (unit
    hidden and class vectors, as in RF-softmax) and the bias is not used.
    """

    has_log_prob = True

    def __init__(self, num_classes: int, hidden_dim: int, *, bias: bool = False,
                 init_std: float | None = None, cosine_scale: float | None = None,
                 reduction: str = "mean", dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if not isinstance(hidden_dim, int) or hidden_dim < 1:
            raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
        if cosine_scale is not None and not cosine_scale > 0:
            raise ValueError(f"cosine_scale must be > 0 or None, got {cosine_scale}")
        if bias and cosine_scale is not None:
            raise ValueError("bias=True cannot be combined with cosine_scale (normalised logits)")
        self.num_classes = num_classes
        self.hidden_dim = hidden_dim
        self.reduction = check_reduction(reduction)
        self.cosine_scale = None if cosine_scale is None else float(cosine_scale)
        std = 1.0 / math.sqrt(hidden_dim) if init_std is None else float(init_std)
        self.weight = nn.Parameter(torch.randn(num_classes, hidden_dim, dtype=dtype, device=device) * std)
        self.bias = nn.Parameter(torch.zeros(num_classes, dtype=dtype, device=device)) if bias else None

    # -- the logits, in pieces -------------------------------------------------
    def _query(self, hidden: Tensor) -> Tensor:
        """The hidden rows as they enter the dot product."""
        if self.cosine_scale is None:
            return hidden
        return self.cosine_scale * F.normalize(hidden, dim=-1)

    def _keys(self, rows: Tensor) -> Tensor:
        """Class vectors as they enter the dot product (rows of W, any leading shape)."""
        return rows if self.cosine_scale is None else F.normalize(rows, dim=-1)

    def _rows(self, table: Tensor, idx: Tensor) -> Tensor:
        """``table[idx]`` for W or b (padding ids read class 0); heads with row-sparse
        gradients gather through ``row_gather`` here."""
        return table[idx.clamp(min=0)]

    def class_logits(self, hidden: Tensor, idx: Tensor) -> Tensor:
        """Logits of the classes ``idx`` (m, K) for each row: (m, K); padding reads class 0."""
        out = torch.einsum("mkd,md->mk", self._keys(self._rows(self.weight, idx)), self._query(hidden))
        if self.bias is not None:
            out = out + self._rows(self.bias, idx)
        return out

    @in_head_dtype
    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        check_hidden(hidden, self.hidden_dim, finite=False)
        end = class_range(self.num_classes, start, end)
        b = None if self.bias is None else self.bias[start:end]
        return F.linear(self._query(hidden), self._keys(self.weight[start:end]), b)

    @in_head_dtype
    @torch.no_grad()
    def target_score(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        return self.class_logits(hidden, target_idx.reshape(-1, 1))[:, 0]

    def log_normaliser(self, hidden: Tensor, chunk_size: int = 65536) -> Tensor:
        """log sum_i exp(o_i) per row, over chunks of classes: (m,)."""
        parts = [torch.logsumexp(sc.float(), dim=1) for _, sc in self.score_chunks(hidden, chunk_size)]
        return torch.logsumexp(torch.stack(parts, 1), dim=1)

    @in_head_dtype
    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """Exact log p(target | h); (m,) for (m,) targets, (m, K) for (m, K) with 0 on padding."""
        idx, _, _ = check_targets(hidden, target_idx, None, self.num_classes, self.hidden_dim)  # as forward's
        lp = self.class_logits(hidden, idx).float() - self.log_normaliser(hidden)[:, None]
        lp = torch.where(idx >= 0, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        return lp.reshape(target_idx.shape)
