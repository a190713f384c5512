"""Inputs and comparisons shared by the lst_kernels tests.

On CPU the Triton kernels run in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so sizes stay tiny; on CUDA the same tests run natively.
"""
from __future__ import annotations

import torch

from lst_kernels import reference as ref

# Triton runs on CUDA tensors natively, on CPU tensors only in the interpreter.
KERNEL_DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]

# (m, K, D, d): m = 1, K > 1, d odd and not a multiple of the block (128), d > block; and
# K = 21 > MAX_BLOCK_K (16), as when a head's negatives drawn per row are extra slots (K + S
# a row): a row's slots in more than one block, the last one partial.
SHAPES = [(1, 1, 4, 1), (1, 3, 4, 37), (6, 1, 3, 133), (7, 3, 5, 37), (9, 4, 3, 16), (4, 21, 30, 37)]
# m = 40: more than one 32-wide tile of m x m outputs.
TILED_SHAPE = (40, 2, 30, 5)

# (state: V, Q, M; activations: X, H; ids) as the head passes them. Its state is float32
# or float64; activations may come in bf16; ids in int64 or int32.
F32 = (torch.float32, torch.float32, torch.int64)
FLOAT_DTYPES = [F32, (torch.float32, torch.bfloat16, torch.int64), (torch.float64, torch.float64, torch.int64)]
DTYPES = FLOAT_DTYPES + [(torch.float32, torch.float32, torch.int32)]


def dtypes_id(dtypes: tuple) -> str:
    return "-".join(str(t).removeprefix("torch.") for t in dtypes)


def make_idx(m: int, K: int, D: int, device: str, ids=torch.int64) -> torch.Tensor:
    """Random targets from few classes, about 1/4 padding; and always, where the shape allows:
    a class repeated within a row and across rows, a padding slot beside a target, a row all padding."""
    idx = torch.randint(0, D, (m, K), device=device)
    idx[torch.rand(m, K, device=device) < 0.25] = -1
    if K > 1:
        idx[0, 1] = idx[0, 0] = D - 1  # a class repeated within a row
    if m > 1:
        idx[1, 0] = D - 1  # the same class in another row
        if K > 1:
            idx[1, -1] = -1
    if m > 2:
        idx[-1] = -1  # an all-padding row
    return idx.to(ids)


def make_case(m, K, D, d, device, dtypes=F32):
    """V (D, d) and G (m, K) in the state dtype, X (m, d) in the activation dtype, idx (m, K)."""
    state, act, ids = dtypes
    V = torch.randn(D, d, device=device).to(state)
    idx = make_idx(m, K, D, device, ids)
    G = torch.randn(m, K, device=device).to(state)
    X = torch.randn(m, d, device=device).to(act)
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


def bookkeeping_inputs(m, d, K, D, device, dtypes=F32):
    """factored_state in the state dtype, H in the activation dtype, with yy and Hq."""
    state, act, _ = dtypes
    s = {k: v.to(device=device, dtype=state) if v.is_floating_point() else v.to(device)
         for k, v in factored_state(m, K, D, d).items()}
    s["H"] = s["H"].to(act)
    s["yy"] = ref.sparse_gram(s["idx"], s["G"])
    s["Hq"] = s["H"].to(state) @ s["Q"]
    return s
