"""Batches of any size, compiled once per batch size (docs/factored_head.md, "Batch shapes").

A compiled step (driver.py) and a CUDA graph (graph_step.py) hold static shapes, so a batch of m
rows and K slots is padded to the step's batch size for m (``padded_rows``: the smallest of
``head.batch_sizes`` at least m; past the largest, and with "pow2", the next power of two, at
least ``MIN_ROWS``) and to the next power of two of K (``padded_slots``): over batches of at most
M rows, at most max(1, ceil(log2 M) - 3) sizes of m (with "pow2"), a graph each, per K.

A padding row changes nothing: its H is zero (the bias column too), its ids -1, its values 0, so
the loss weighs it 0 (the "mean" reduction divides by the batch's own rows, ``rows``, a device
count the step reads: no graph per m), P's moments do not count it, and its share of every product
of the step is an exact zero. The sampled classes' draw is the batch's own: the uniforms of the m
rows (``before_step``), zeros appended for the padding rows (``pad_draws``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.functional import pad

#: the smallest batch size of "pow2": every batch of up to MIN_ROWS rows takes one graph
MIN_ROWS = 16

def check_batch_sizes(value) -> str | tuple[int, ...]:
    """``batch_sizes``: "pow2" or a non-empty sequence of positive ints (kept sorted, unique)."""
    if value == "pow2":
        return value
    ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    if not ok:
        raise ValueError(f"batch_sizes must be 'pow2' or a non-empty sequence of positive ints, got {value!r}")
    return tuple(sorted(set(value)))


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_rows(m: int, sizes: str | tuple[int, ...]) -> int:
    """The batch size a batch of m rows is padded to."""
    if sizes != "pow2":
        for size in sizes:
            if size >= m:
                return size
    return max(next_power_of_two(m), MIN_ROWS)


def padded_slots(K: int) -> int:
    """The target slots a batch of K slots a row is padded to: the next power of two."""
    return next_power_of_two(K)


def pad_rows(t: Tensor, M: int, value=0) -> Tensor:
    """``t`` (m, ...) with rows of ``value`` appended up to M."""
    if t.shape[0] == M:
        return t
    return pad(t, (0, 0) * (t.dim() - 1) + (0, M - t.shape[0]), value=value)


def pad_batch(Hx: Tensor, idx: Tensor, T: Tensor, M: int, K: int) -> tuple[Tensor, Tensor, Tensor]:
    """The batch padded to M rows of K slots: H 0, ids -1, values 0."""
    k = idx.shape[1]
    if k < K:
        idx, T = pad(idx, (0, K - k), value=-1), pad(T, (0, K - k), value=0.0)
    return pad_rows(Hx, M), pad_rows(idx, M, -1), pad_rows(T, M)


def pad_draws(head, draws: Tensor | None, m: int, M: int) -> Tensor | None:
    """The uniforms of the sampled classes' draw for the m rows, padded for M: per-row negatives
    take S a row (zeros for the padding rows, whose slots weigh 0); shared ones are S for any m."""
    if draws is None or head.negatives.settings.shared or m == M:
        return draws
    return pad(draws, (0, (M - m) * head.negatives.settings.num))


def batch_size(head, m: int, K: int) -> tuple[int, int] | None:
    """(M, K) a compiled step (driver.py asks only where it runs compiled) pads a batch
    of m rows of K slots to; None for several processes' rows exchanged padded to the capacity
    they agreed on (padded_rows.py), a batch size already (``sync_every=1`` gathers their exact
    rows, padded here)."""
    if head.processes.rows is not None:
        return None
    return padded_rows(m, head.driving.batch_sizes), padded_slots(K)


def real_rows(Hx: Tensor, m: int) -> Tensor:
    """The batch's own rows as a device count (a fill: no host transfer, no graph per m)."""
    return torch.full((), m, dtype=torch.int64, device=Hx.device)
