"""The table of ops (ops.py): every op registered once, every public function made from it,
the shared launch constants."""
from __future__ import annotations

import inspect

import pytest
import torch

import lst_kernels
from lst_kernels import _launch, checks, reference
from lst_kernels.ops import OPS


def test_every_public_op_is_in_the_table_with_the_reference_signature():
    assert set(OPS) == {n for n in lst_kernels.__all__ if n != "reference"}
    for name, op in OPS.items():
        assert inspect.signature(getattr(lst_kernels, name)) == inspect.signature(op.reference), name
        assert op.check.__module__ == checks.__name__ and op.reference is getattr(reference, name)
        params = list(inspect.signature(op.check).parameters)
        assert params == list(inspect.signature(op.reference).parameters), name  # the check sees every argument


@pytest.mark.parametrize("K,want", [(1, 2), (2, 2), (3, 4), (8, 8), (9, 16), (16, 16), (17, 16), (1000, 16)])
def test_block_k_is_the_next_power_of_two_within_bounds(K, want):
    assert _launch.block_k(K) == want


def test_tiles():
    assert _launch.tile(4096, 4) == 64 and _launch.tile(4096, 8) == 32 and _launch.tile(512, 2) == 32
