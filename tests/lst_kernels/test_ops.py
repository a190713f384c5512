"""The implementations, unchecked (ops.py): the rule choosing one once, and each public op is its
checks and the chosen implementation's call (the same bits)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from kernel_cases import make_case

import lst_kernels
from lst_kernels import functional, ops, reference, torch_ops


def test_the_choice_of_implementation(monkeypatch):
    monkeypatch.delenv("LST_KERNELS", raising=False)
    assert lst_kernels.ops_for(torch.device("cpu")) is ops.TORCH and lst_kernels.ops_for("cpu", "torch") is ops.TORCH
    assert not ops.use_triton("cpu") and ops.use_triton("cpu", "triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.use_triton("cpu", "cuda")
    monkeypatch.setattr(ops, "_TRITON_IMPORTABLE", False)
    assert lst_kernels.ops_for("cuda") is ops.TORCH  # CUDA without Triton: torch


def test_lst_kernels_torch_keeps_cuda_on_torch_read_at_the_choice(monkeypatch):
    monkeypatch.setattr(ops, "_TRITON_IMPORTABLE", True)
    monkeypatch.delenv("LST_KERNELS", raising=False)
    assert ops.use_triton(torch.device("cuda", 0))
    monkeypatch.setenv("LST_KERNELS", "torch")
    assert not ops.use_triton("cuda") and lst_kernels.ops_for("cuda") is ops.TORCH
    assert ops.use_triton("cuda", "triton")  # impl= forces either


def test_the_torch_ops_are_the_references_and_torch_ops():
    assert ops.TORCH.impl == "torch"
    assert {ops.TORCH.gather_dot, ops.TORCH.gather_sum, ops.TORCH.sparse_gram} == {
        reference.gather_dot, reference.gather_sum, reference.sparse_gram}
    for f in dataclasses.fields(ops.Ops)[1:]:
        op = getattr(ops.TORCH, f.name)
        assert callable(op) and op.__module__ in (reference.__name__, torch_ops.__name__), f.name


@pytest.mark.skipif(not ops._TRITON_IMPORTABLE, reason="the Triton ops need triton (a Linux x86-64 dependency)")
def test_every_op_of_either_implementation_takes_the_public_ops_arguments_but_impl():
    TRITON = ops.triton_impl()
    assert TRITON.impl == "triton" and lst_kernels.ops_for("cpu", "triton") is TRITON
    for f in dataclasses.fields(ops.Ops)[1:]:
        public = "of" if f.name == "sorted_ids" else f.name
        want = [p for p in inspect.signature(getattr(functional.SortedIds if public == "of" else functional, public))
                .parameters if p != "impl"]
        for impl in (ops.TORCH, TRITON):
            assert list(inspect.signature(getattr(impl, f.name)).parameters) == want, (impl.impl, f.name)


def test_a_public_op_is_its_checks_and_the_chosen_ops_call():
    V, idx, G, X = make_case(6, 2, 9, 5, "cpu")
    order = lst_kernels.SortedIds.of(idx)
    assert torch.equal(ops.TORCH.sorted_ids(idx).keys, order.keys) and torch.equal(ops.TORCH.sorted_ids(idx).perm,
                                                                                    order.perm)
    checked, direct = V.clone(), V.clone()
    lst_kernels.scatter_add_rows_(checked, idx, G, X, -0.5, order=order)
    ops.TORCH.scatter_add_rows_(direct, idx, G, X, -0.5, order=order)
    assert torch.equal(checked, direct)
    assert torch.equal(lst_kernels.gram_rows(idx, G, X), ops.TORCH.gram_rows(idx, G, X))
    with pytest.raises(TypeError, match="idx must be int64 or int32"):
        lst_kernels.SortedIds.of(idx.float())  # the public sort checks; the implementations' does not
