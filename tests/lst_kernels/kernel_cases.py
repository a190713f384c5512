"""Inputs and comparisons shared by the lst_kernels tests.

On CPU the Triton kernels run in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so sizes stay tiny; on CUDA the same tests run natively.
"""
from __future__ import annotations

import torch

from lst_kernels import reference as ref

# Triton runs on CUDA tensors natively, on CPU tensors only in the interpreter.
KERNEL_DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]

# (m, K, D, d): m = 1, K > 1, d odd and not a multiple of the block (128), d > block.
SHAPES = [(1, 1, 4, 1), (1, 3, 4, 37), (6, 1, 3, 133), (7, 3, 5, 37), (9, 4, 3, 16)]
# m = 40: more than one 32-wide tile of m x m outputs.
TILED_SHAPE = (40, 2, 30, 5)

X_DTYPES = [torch.float32, torch.bfloat16]


def make_idx(m: int, K: int, D: int, device: str) -> torch.Tensor:
    """Random targets from few classes (repeats across and within rows), about 1/4 padding."""
    idx = torch.randint(0, D, (m, K), device=device)
    idx[torch.rand(m, K, device=device) < 0.25] = -1
    if K > 1:
        idx[0, 1] = idx[0, 0] = D - 1  # a class repeated within a row
    if m > 2:
        idx[-1] = -1  # an all-padding row
    return idx


def make_case(m, K, D, d, device, x_dtype=torch.float32):
    V = torch.randn(D, d, device=device)
    idx = make_idx(m, K, D, device)
    G = torch.randn(m, K, device=device)
    X = torch.randn(m, d, device=device).to(x_dtype)
    return V, idx, G, X


def close(actual, expected, rtol=1e-5):
    """Equal up to float32 rounding, relative to the size of the expected values."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1.0))


def dense_yd(idx, G, D):
    """The K-sparse m x D matrix Yd, built explicitly."""
    m, K = idx.shape
    Yd = torch.zeros(m, D, dtype=torch.float64)
    for j in range(m):
        for k in range(K):
            if idx[j, k] >= 0:
                Yd[j, idx[j, k]] += float(G[j, k])
    return Yd


def factored_state(m, K, D, d, seed_scale=0.5):
    """A materialised W with all inputs of m_matrix / q_update, in float64."""
    dt = torch.float64
    W = torch.randn(D, d, dtype=dt) * seed_scale
    H = torch.randn(m, d, dtype=dt)
    idx = make_idx(m, K, D, "cpu")
    G = torch.randn(m, K, dtype=dt)
    G[idx < 0] = 0.0  # the head's dL/dA is zero at padding slots
    gq, gs = torch.randn(m, dtype=dt), torch.randn(m, dtype=dt)
    Q, wbar = W.T @ W, W.sum(0)
    Yd = dense_yd(idx, G, D)
    dO = 2 * gq[:, None] * (H @ W.T) + gs[:, None] + Yd
    Z = ref.gather_sum(W, idx, G) + gs[:, None] * wbar[None, :]
    return dict(W=W, H=H, idx=idx, G=G, gq=gq, gs=gs, Q=Q, Yd=Yd, dO=dO, Z=Z, ybar=G.sum(1))


def bookkeeping_inputs(m, d, K, D, device, h_dtype):
    s = factored_state(m, K, D, d)
    f32 = {k: v.to(device=device, dtype=torch.float32) if v.is_floating_point() else v.to(device)
           for k, v in s.items()}
    f32["H"] = f32["H"].to(h_dtype)
    f32["yy"] = ref.sparse_gram(f32["idx"], f32["G"])
    f32["Hq"] = f32["H"].float() @ f32["Q"]
    return f32
