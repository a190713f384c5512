"""The gated fold (``lst_kernels.fold_rows_``): V <- V M in place where a device flag says so,
nothing otherwise; the Triton kernel (the flag read in the kernel) and the CPU's custom op
against the reference, and the op inside a compiled graph, mutating V in place."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import KERNEL_DEVICES

import lst_kernels
from lst_kernels import reference as ref

# (D, d): one row; fewer rows than a program's block; d odd, below and above a column block
# (64) and the inner chunk (16); more row blocks than the persistent grid's programs (256 x 16).
FOLD_SHAPES = [(1, 1), (5, 3), (40, 37), (33, 130), (4200, 2)]


def case(D: int, d: int, dtype, device):
    g = torch.Generator().manual_seed(D * 1000 + d)
    return (torch.randn(D, d, generator=g, dtype=dtype).to(device),
            torch.randn(d, d, generator=g, dtype=dtype).to(device))


#: (shape, dtype): every shape in float32 and float64; the persistent grid's loop (4 200 rows: more
#: blocks than programs) in float64 with -m slow (Triton's interpreter: seconds a case)
FOLD_CASES = [pytest.param(shape, dtype, id=f"{shape[0]}x{shape[1]}-{name}",
                           marks=pytest.mark.slow if shape[0] > 4096 and name == "f64" else ())
              for shape in FOLD_SHAPES for name, dtype in (("f32", torch.float32), ("f64", torch.float64))]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape,dtype", FOLD_CASES)
def test_the_fold_where_the_flag_is_set_and_nothing_where_not(shape, dtype, device, impl):
    if impl == "triton":
        pytest.importorskip("triton")
    V, M = case(*shape, dtype, device)
    for flag in (torch.tensor(True, device=device), torch.tensor(1, device=device), True):
        out, want = V.clone(), ref.fold_rows_(V.clone(), M, flag)
        assert lst_kernels.fold_rows_(out, M, flag, impl=impl) is out
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    for flag in (torch.tensor(False, device=device), torch.zeros(1, dtype=torch.int32, device=device), False):
        out = V.clone()
        lst_kernels.fold_rows_(out, M, flag, impl=impl)
        assert torch.equal(out, V)  # not a bit moved


def test_bad_arguments_raise_before_anything_changes():
    V, M = case(5, 3, torch.float64, "cpu")
    before = V.clone()
    with pytest.raises(ValueError, match=r"M must have shape \(3, 3\)"):
        lst_kernels.fold_rows_(V, M[:2], True)
    with pytest.raises(TypeError, match="flag must be a bool or a one-element"):
        lst_kernels.fold_rows_(V, M, torch.tensor([True, False]))
    with pytest.raises(TypeError, match="flag must be a bool or a one-element"):
        lst_kernels.fold_rows_(V, M, 0.5)
    assert torch.equal(V, before)


def test_a_compiled_graph_takes_the_op_whole_and_folds_v_in_place():
    """One graph, no break; the fold decided by a tensor computed in the graph."""
    torch._dynamo.reset()
    V, M = case(40, 6, torch.float64, "cpu")

    def step(V, M, x):
        flag = x.sum() > 0
        lst_kernels.fold_rows_(V, M, flag)
        return V.sum()

    explained = torch._dynamo.explain(step)(V.clone(), M, torch.ones(3))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    fn = torch.compile(step, fullgraph=True, dynamic=False)
    for sign in (1.0, -1.0):
        out, want = V.clone(), V.clone()
        data_ptr = out.data_ptr()
        fn(out, M, sign * torch.ones(3))
        ref.fold_rows_(want, M, sign > 0)
        assert out.data_ptr() == data_ptr
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
