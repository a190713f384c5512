"""The Triton kernels compile for the GPUs the project targets, on a machine without one.

The interpreter runs kernels that the GPU compiler may still reject (dtype mixes,
tl.dot shapes, resources), so every specialisation the launchers really produce is
compiled to cubin for sm_80 (A100) and sm_90 (H100) by compile_launches.py, and
checked against the limits a launch on that GPU enforces.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
# In the default suite: it is what makes CI fail on a kernel the GPU compiler rejects
# (1.5 min of compiling with an empty Triton cache on the 2-core machine, lightly loaded).
from lst_kernels._launch import block_k, tile  # noqa: E402

CCS = [80, 90]
# Opt-in shared memory per block and registers per block of the A100 (8.0) and H100 (9.0);
# Triton refuses to launch a kernel that needs more.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
MAX_REGISTERS = 64 * 1024

_F = {"*fp32", "*fp64"}  # the head's state: float32 or float64
_FB = _F | {"*bf16"}  # activations and loss gradients may also be bf16
_IDS = {"*i64", "*i32"}
# What the recorded launches must include: each dtype the head passes, and each block
# size the launchers can choose (from their shared launch constants, _launch.py).
_BLOCK_K = {block_k(K) for K in range(1, 65)}
_TILES = {tile(m, itemsize) for m in (1, 4096) for itemsize in (2, 4, 8)}
COVERAGE = {
    "_gather_dot_kernel": {"V": _F, "X": _FB, "IDX": _IDS, "HAS_X0": {True, False}, "BLOCK_K": _BLOCK_K},
    "_gather_sum_kernel": {"V": _F, "G": _FB, "IDX": _IDS, "BLOCK_K": _BLOCK_K},
    "_scatter_add_rows_kernel": {"V": _F, "G": _FB, "X": _FB, "ALPHA_PTR": {True, False}},
    "_sparse_gram_kernel": {"IDX": _IDS, "G": _FB},
    "_m_matrix_kernel": {"H": _FB, "M": _F, "BLOCK": _TILES},
    "_q_update_kernel": {"Q": _F, "C_PTR": {True, False}},
    "_fold_rows_kernel": {"V": _F, "FP64": {True, False}},
}


@pytest.fixture(scope="module")
def compiled() -> dict[int, dict]:
    """compile_launches.py's report per target; one child process per target, side by side.

    Children, because this process runs the interpreter (TRITON_INTERPRET=1 on CPU), under
    which @triton.jit makes functions that cannot be compiled.
    """
    script = Path(__file__).with_name("compile_launches.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    children = {cc: subprocess.Popen([sys.executable, str(script), str(cc)], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE) for cc in CCS}
    reports = {}
    for cc, child in children.items():
        out, err = child.communicate()
        assert child.returncode == 0, f"compile_launches.py {cc} failed:\n{err[-4000:]}"
        reports[cc] = json.loads(out.splitlines()[-1])
    return reports


def describe(spec: dict) -> str:
    """The kernel, its argument types, the values compiled in and the arguments known aligned."""
    args = ", ".join(f"{a}: {ty}" for a, ty in spec["signature"].items() if ty != "constexpr")
    aligned = [a for a, attrs in spec["attrs"].items() if ["tt.divisibility", 16] in attrs]
    return f"{spec['kernel']}({args}; {spec['constants']}; multiples of 16: {aligned})"


def value(spec: dict, arg: str):
    """The argument as launched: its type, or its value if it was compiled in."""
    ty = spec["signature"][arg]
    return spec["constants"][arg] if ty == "constexpr" else ty


@pytest.mark.parametrize("cc", CCS)
def test_every_kernel_is_launched(compiled, cc):
    report = compiled[cc]
    assert report["kernels"] == sorted(COVERAGE)
    assert {spec["kernel"] for spec in report["compiled"]} == set(report["kernels"])


@pytest.mark.parametrize("cc", CCS)
def test_every_launch_compiles_to_cubin(compiled, cc):
    specs = compiled[cc]["compiled"]
    failed = [f"{describe(s)}: {s['error']}" for s in specs if s["error"]]
    assert not failed, "\n\n".join(failed)
    assert all(s["cubin_bytes"] > 0 and s["arch"] == cc for s in specs)


@pytest.mark.parametrize("cc", CCS)
def test_every_launch_fits_the_gpu(compiled, cc):
    specs = compiled[cc]["compiled"]
    too_big = [f"{describe(s)}: {s['shared']} B shared, {s['regs']} registers x {s['num_warps']} warps"
               for s in specs
               if s["shared"] > MAX_SHARED[cc] or s["regs"] * s["num_warps"] * 32 > MAX_REGISTERS]
    assert not too_big, "\n".join(too_big)


@pytest.mark.parametrize("cc", CCS)
def test_launches_cover_what_the_head_passes(compiled, cc):
    specs = compiled[cc]["compiled"]
    for kernel, args in COVERAGE.items():
        for arg, expected in args.items():
            seen = {value(s, arg) for s in specs if s["kernel"] == kernel}
            assert expected <= seen, f"{kernel}.{arg}: {sorted(map(str, expected - seen))} never launched"
