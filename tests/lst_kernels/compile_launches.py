"""Compile every launch of the lst_kernels Triton kernels for a GPU, without a GPU.

A program: ``python compile_launches.py 90`` prints one JSON document for sm_90.
It must run without TRITON_INTERPRET: under the interpreter ``@triton.jit`` makes
InterpretedFunctions, which have no compiler behind them.

The public Triton ops are called on small CPU tensors while a stand-in driver names
the target. Triton's own launch path (``JITFunction.run``) then binds and specialises
the arguments exactly as it would on that GPU (pointer dtypes, ints equal to 1 made
constant, divisibility by 16) and hands the result to ``knobs.runtime.jit_cache_hook``,
which records it and stops the launch. Each distinct specialisation is compiled to
cubin by ``JITFunction.preload``, Triton's path for compiling recorded launches ahead
of time. So what is compiled is what the launchers pass, never a copy of it.
"""
from __future__ import annotations

import functools
import importlib
import json
import pkgutil
import re
import subprocess
import sys
import types

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

import lst_kernels

#: The public ops with their Triton path forced (CPU tensors: the stand-in driver records each launch).
tri = types.SimpleNamespace(**{name: functools.partial(getattr(lst_kernels, name), impl="triton")
                               for name in lst_kernels.__all__ if name != "reference"})

# What the head passes: (state dtype of V, Q, ...; activation dtype of H, X, G; id dtype).
PROFILES = [
    (torch.float32, torch.float32, torch.int64),
    (torch.float32, torch.bfloat16, torch.int32),
    (torch.float64, torch.float64, torch.int64),
]
# (m, K, D, d) in the first profile: K gives BLOCK_K 2, 4, 8, 16 (and K = 1 is made
# constant by Triton); d odd or a multiple of 16 (aligned, vectorised loads).
SHAPES = [(3, 1, 5, 37), (4, 3, 7, 64), (4, 8, 9, 37), (2, 20, 30, 64)]
BIG_M = 1024  # m from which m_matrix takes 64-wide tiles


class TargetOnlyDriver(DriverBase):
    """Enough of a driver for JITFunction.run to specialise a launch for one target."""

    def __init__(self, target: GPUTarget):
        super().__init__()
        self.target = target

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError("nothing is launched")

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("nothing is launched")

    def get_current_device(self):
        return self.target.arch  # its own key in the kernels' per-device caches

    def get_current_stream(self, device=None):
        return 0


def sparse_op_calls(state, act, ids, m, K, D, d):
    idx = torch.randint(-1, D, (m, K), dtype=ids)
    V = torch.randn(D, d, dtype=state)
    X = torch.randn(m, d, dtype=act)
    G = torch.randn(m, K, dtype=act)
    tri.gather_dot(V, idx, X, torch.randn(m, dtype=act))
    tri.gather_dot(V, idx, X)
    tri.gather_sum(V, idx, G)
    tri.scatter_add_rows_(V, idx, G, X, 0.5)
    tri.scatter_add_rows_(V, idx, G, X, torch.tensor(0.5, dtype=state))  # a device lr
    tri.sparse_gram(idx, G)


def m_matrix_call(state, act, m, D, d):
    H = torch.randn(m, d, dtype=act)
    Hq, Z = torch.randn(m, d, dtype=state), torch.randn(m, d, dtype=state)
    gq, gs, ybar = (torch.randn(m, dtype=state) for _ in range(3))
    return tri.m_matrix(Hq, H, Z, gq, gs, ybar, D, torch.randn(m, m, dtype=state))


def q_update_calls(state, act, M, d):
    m = M.shape[0]
    Q, H, dH = torch.randn(d, d, dtype=state), torch.randn(m, d, dtype=act), torch.randn(m, d, dtype=state)
    tri.q_update(Q, H, dH, M, 0.05, 0.97)
    tri.q_update(Q, H, dH, M, torch.tensor(0.05, dtype=state), torch.tensor(0.97, dtype=state))  # device lr, c


def fold_calls(state, D, d):
    V, M = torch.randn(D, d, dtype=state), torch.randn(d, d, dtype=state)
    tri.fold_rows_(V, M, torch.tensor(True))


def launch_all():
    for state, _, _ in PROFILES[:1] + PROFILES[2:]:
        fold_calls(state, *SHAPES[1][2:])
    for state, act, ids in PROFILES:
        m, K, D, d = SHAPES[1]
        sparse_op_calls(state, act, ids, m, K, D, d)
        q_update_calls(state, act, m_matrix_call(state, act, m, D, d), d)
        m_matrix_call(state, act, BIG_M, D, d)
    state, act, ids = PROFILES[0]
    for m, K, D, d in SHAPES[:1] + SHAPES[2:]:
        sparse_op_calls(state, act, ids, m, K, D, d)
    m, _, D, d = SHAPES[0]
    q_update_calls(state, act, m_matrix_call(state, act, m, D, d), d)  # odd d: unaligned rows


def record_launches(target: GPUTarget) -> dict:
    """{(kernel name, specialisation key): (JITFunction, specialisation data)} of all launches."""
    launches = {}

    def hook(*, key, fn, compile, is_manual_warmup, **_):
        if is_manual_warmup:
            return None  # preload's own call: let it compile
        launches[(fn.name, str(key))] = (fn.jit_function, compile["specialization_data"])
        return True  # recorded: skip compiling and launching

    driver.set_active(TargetOnlyDriver(target))
    knobs.runtime.jit_cache_hook = hook
    launch_all()
    return launches


def named(paths: list, values: list, arg_names: list[str]) -> dict:
    return {arg_names[p[0]]: v for p, v in zip(paths, values)}


def resource_usage(kernel) -> dict:
    """Registers and stack bytes (spills) per thread, as ptxas left them in the cubin."""
    cubin = next(p for name, p in kernel.metadata_group.items() if name.endswith(".cubin"))
    text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin],
                          capture_output=True, text=True, check=True).stdout
    return {"regs": int(re.search(r"REG:(\d+)", text)[1]), "stack": int(re.search(r"STACK:(\d+)", text)[1])}


def compile_one(fn, data: str) -> dict:
    spec = json.loads(data)
    out = {
        "kernel": fn.__name__,
        "signature": spec["signature"],
        "constants": named(spec["constant_keys"], spec["constant_vals"], fn.arg_names),
        "attrs": named(spec["attrs_keys"], spec["attrs_vals"], fn.arg_names),
    }
    try:
        k = fn.preload(data)
    except Exception as e:  # the compiler's refusal is the result
        return {**out, "error": f"{type(e).__name__}: {e}"[:4000]}
    return {**out, "error": None, "cubin_bytes": len(k.asm["cubin"]), "shared": k.metadata.shared,
            "num_warps": k.metadata.num_warps, "arch": k.metadata.target.arch, **resource_usage(k)}


def all_kernels() -> list[str]:
    """Every launchable kernel of the package: the JITFunctions named ``*_kernel``."""
    names = set()
    for mod in pkgutil.iter_modules(lst_kernels.__path__):
        if mod.name.endswith(("_kernel", "_kernels")):
            module = importlib.import_module(f"lst_kernels.{mod.name}")
            names |= {n for n, v in vars(module).items()
                      if isinstance(v, triton.runtime.JITFunction) and n.endswith("_kernel")}
    return sorted(names)


def main(cc: int) -> dict:
    torch.manual_seed(0)
    target = GPUTarget("cuda", cc, 32)
    launches = record_launches(target)
    return {"cc": cc, "kernels": all_kernels(),
            "compiled": [compile_one(fn, data) for fn, data in launches.values()]}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
