"""Full softmax head: cross-entropy over all D classes through a fused
linear + cross-entropy that never holds the (m, D) logits at once.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import LinearClassHead
from ..heads.targets import check_targets, in_head_dtype, reduce_rows

IMPLS = ("torch", "liger", "cce")
_OPTIONAL = {"liger": ("liger_kernel.transformers.functional", "liger-kernel"),
             "cce": ("cut_cross_entropy", "cut-cross-entropy")}


def _load_impl(impl: str):
    """The fused function of an optional implementation, or a clear ImportError."""
    module, package = _OPTIONAL[impl]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"SoftmaxHead(impl={impl!r}) needs the optional package {package!r} "
                          f"(pip install {package}); use impl='torch' otherwise") from exc
    return mod.liger_fused_linear_cross_entropy if impl == "liger" else mod.linear_cross_entropy


#: cut-cross-entropy's CUDA kernels index W with 32-bit offsets: an H200 run at D = 2 x 10^7,
#: d = 512 (10^10 elements) ended in an illegal memory access, which poisons the process's
#: CUDA context (793 471 x 512 runs)
CCE_MAX_ELEMENTS = 2**31 - 1


def check_cce_size(num_elements: int, on_cuda: bool) -> None:
    """Refuse, in one line and before any launch, a W too large for cut-cross-entropy's kernels."""
    if on_cuda and num_elements > CCE_MAX_ELEMENTS:
        raise ValueError(f"SoftmaxHead(impl='cce') on CUDA takes at most 2^31 - 1 weight elements (its kernels "
                         f"index with 32 bits), this W has {num_elements:,}; use impl='liger', or impl='torch' "
                         "(chunked), or a sampled or factored head")


def _cce(x: Tensor, W: Tensor, bias: Tensor | None, target: Tensor, reduction: str) -> Tensor:
    """Cut cross-entropy: its Triton kernels on CUDA, its torch path elsewhere. It takes no
    bias: a bias joins W as one more column, against a constant column of ones in x."""
    check_cce_size(W.shape[0] * (W.shape[1] + (bias is not None)), x.is_cuda)
    if bias is not None:
        x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
        W = torch.cat([W, bias[:, None].to(W.dtype)], 1)
    return _load_impl("cce")(x, W, target, ignore_index=-1, reduction=reduction,
                             impl="cce" if x.is_cuda else "torch_compile")


class SoftmaxHead(LinearClassHead):
    """Softmax cross-entropy over all classes.

    ``impl``: ``torch`` (``F.linear_cross_entropy``; ``chunked=True`` passes
    ``LinearCrossEntropyOptions`` so the batch is processed in chunks of rows
    whose logits hold at most ``chunk_elements`` numbers; a torch without it, before 2.13,
    gets ``F.linear`` + ``F.cross_entropy``, the same loss unfused), or on
    CUDA ``liger`` (Liger-Kernel's fused linear cross-entropy), or ``cce`` (Apple's cut
    cross-entropy: its Triton kernels on CUDA, its torch path elsewhere), both optional installs.
    """

    def __init__(self, num_classes: int, hidden_dim: int, *, impl: str = "torch", chunked: bool = True,
                 chunk_elements: int = 1 << 24, bias: bool = False, init_std: float | None = None, cosine_scale: float | None = None,
                 reduction: str = "mean", dtype: torch.dtype | None = None, device=None):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
        if impl != "torch":
            _load_impl(impl)  # fail at construction, not at the first step
        super().__init__(num_classes=num_classes, hidden_dim=hidden_dim, bias=bias, init_std=init_std,
                         cosine_scale=cosine_scale, reduction=reduction, dtype=dtype, device=device)
        self.impl = impl
        self.chunked = bool(chunked)
        self.chunk_elements = chunk_elements

    def _fused(self, x: Tensor, target: Tensor, reduction: str) -> Tensor:
        """Fused linear + cross-entropy of rows ``x`` against 1-D ``target`` (-1 ignored)."""
        W = self._keys(self.weight)
        if self.impl == "torch":
            if not hasattr(F, "linear_cross_entropy"):
                # torch before 2.13 (2.11, 2.12): the same loss, unfused,
                # its (rows, D) logits made whole. Benchmarks say which torch they ran on.
                return F.cross_entropy(F.linear(x, W, self.bias), target, ignore_index=-1, reduction=reduction)
            options = None
            if self.chunked:
                # An explicit chunk: torch's float32 CPU heuristic picks chunks that run
                # 20-40x slower than the unchunked path (measured, torch 2.13, 2-core EPYC).
                rows = max(1, min(x.shape[0], self.chunk_elements // self.num_classes))
                options = nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=rows)
            return F.linear_cross_entropy(x, W, target, linear_bias=self.bias, ignore_index=-1,
                                          reduction=reduction, options=options)
        if self.impl == "cce":
            return _cce(x, W, self.bias, target, reduction)
        if not x.is_cuda:
            raise ValueError(f"SoftmaxHead(impl={self.impl!r}) runs on CUDA only; hidden is on {x.device}")
        return _load_impl(self.impl)(x, W, target, bias=self.bias, ignore_index=-1, reduction=reduction)

    def cannot_compile(self) -> str | None:
        if self.impl == "torch" and hasattr(F, "linear_cross_entropy"):
            return "torch.compile does not trace F.linear_cross_entropy: torch's fused kernel runs as it is"
        if self.impl != "torch":
            return f"impl={self.impl!r} runs its own fused Triton kernels as they are"
        return None

    @in_head_dtype
    def forward(self, hidden: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        idx, val, _ = check_targets(hidden, target_idx, target_val, self.num_classes, self.hidden_dim)
        x = self._query(hidden)
        m, K = idx.shape
        if K == 1 and target_val is None:
            per_sum = self._fused(x, idx[:, 0], "sum")
            total = per_sum if self.reduction == "sum" else per_sum / m
            return reduce_rows(total.reshape(1), "sum")
        # Several targets per row, or weights: one cross-entropy per slot, weighted.
        rows = x.repeat_interleave(K, dim=0)
        per_slot = self._fused(rows, idx.reshape(-1), "none").reshape(m, K)
        return reduce_rows((val * per_slot).sum(1), self.reduction)
