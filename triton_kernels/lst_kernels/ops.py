"""The ops of one implementation, unchecked, and the rule choosing it once.

An ``Ops`` is an immutable namespace of the ops (the public ones' arguments, no ``impl``, no
check): ``TORCH``, the plain-torch implementation (``reference.py``'s three sparse ops as they
are, ``torch_ops.py``'s), and the Triton one (``triton_impl()``: ``triton_ops.py``'s, the
launchers of ``<op>_kernel(s).py``; imported, with Triton, when first chosen). ``ops_for(device, impl)``
chooses one: ``impl="auto"`` takes Triton on a CUDA device when Triton is importable and the
environment's ``LST_KERNELS`` is not ``"torch"`` (read at the call), torch otherwise;
``"torch"`` and ``"triton"`` force either. The public ops (``functional.py``) check their
arguments, then call the ``Ops`` this rule chooses at each call; a caller that checks its inputs
once chooses once (the factored head's ``StepPlan.kernels``) and calls the ops directly.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import reference, torch_ops

IMPLS = ("auto", "torch", "triton")
_TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Ops:
    """The ops of one implementation (``impl``: "torch" or "triton"), each with the public op's
    arguments but ``impl`` (``order=`` and ``q_update_factors``' made products by keyword too), and
    ``sorted_ids(idx)``, ``SortedIds.of`` unchecked. Inputs are taken as checked."""

    impl: str
    gather_dot: Callable
    gather_sum: Callable
    scatter_add_rows_: Callable
    sparse_gram: Callable
    gram_rows: Callable
    m_matrix: Callable
    q_update: Callable
    q_update_factors: Callable
    logsumexp_rows: Callable
    fold_rows_: Callable
    sorted_ids: Callable


TORCH = Ops("torch", gather_dot=reference.gather_dot, gather_sum=reference.gather_sum,
            scatter_add_rows_=torch_ops.scatter_add_rows_, sparse_gram=reference.sparse_gram,
            gram_rows=torch_ops.gram_rows, m_matrix=torch_ops.m_matrix, q_update=torch_ops.q_update,
            q_update_factors=torch_ops.q_update_factors, logsumexp_rows=torch_ops.logsumexp_rows,
            fold_rows_=torch_ops.fold_rows_, sorted_ids=torch_ops.SortedIds.sort)


@functools.cache
def triton_impl() -> Ops:
    """The Triton implementation (``triton_ops.py``'s ops), made at the first call; imports Triton."""
    from . import triton_ops as t  # noqa: PLC0415  (imports Triton)
    return Ops("triton", gather_dot=t.gather_dot, gather_sum=t.gather_sum, scatter_add_rows_=t.scatter_add_rows_,
               sparse_gram=t.sparse_gram, gram_rows=t.gram_rows, m_matrix=t.m_matrix, q_update=t.q_update,
               q_update_factors=t.q_update_factors, logsumexp_rows=t.logsumexp_rows, fold_rows_=t.fold_rows_,
               sorted_ids=t.SortedIds.sort)


def use_triton(device: torch.device | str, impl: str = "auto") -> bool:
    """Whether ``impl`` on ``device`` is the Triton implementation (the rule above)."""
    if impl == "auto":
        return (torch.device(device).type == "cuda" and _TRITON_IMPORTABLE
                and os.environ.get("LST_KERNELS", "auto") != "torch")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl == "triton"


def ops_for(device: torch.device | str, impl: str = "auto") -> Ops:
    """The ``Ops`` for tensors on ``device``: Triton's (``triton_impl()``) where ``use_triton``, else
    ``TORCH``."""
    return triton_impl() if use_triton(device, impl) else TORCH
