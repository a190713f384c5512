"""The sparse ops and bookkeeping of the factored head: references against
brute-force loops and dense algebra, Triton kernels against the references.

On CPU the Triton kernels run in the interpreter (conftest sets
TRITON_INTERPRET=1), so sizes stay tiny; on CUDA the same tests run natively.
"""
from __future__ import annotations

import pytest
import torch

from lst_kernels import reference as ref

pytest.importorskip("triton")
from lst_kernels import triton_ops as tri  # noqa: E402

CUDA = torch.cuda.is_available()
# Triton runs on CUDA tensors natively, on CPU tensors only in the interpreter.
KERNEL_DEVICES = ["cuda"] if CUDA else ["cpu"]
REF_DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]

# (m, K, D, d): m = 1, K > 1, d odd and not a multiple of the block (128), d > block.
SHAPES = [(1, 1, 4, 1), (1, 3, 4, 37), (6, 1, 3, 133), (7, 3, 5, 37), (9, 4, 3, 16)]


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


# --- brute force -----------------------------------------------------------

def loop_gather_dot(V, idx, X, x0):
    m, K = idx.shape
    A = torch.zeros(m, K, dtype=torch.float64)
    for j in range(m):
        for k in range(K):
            c = int(idx[j, k])
            if c >= 0:
                A[j, k] = sum(float(X[j, e]) * float(V[c, e]) for e in range(V.shape[1]))
                A[j, k] += 0.0 if x0 is None else float(x0[j])
    return A


def loop_gather_sum(V, idx, G):
    m, K = idx.shape
    Y = torch.zeros(m, V.shape[1], dtype=torch.float64)
    for j in range(m):
        for k in range(K):
            c = int(idx[j, k])
            if c >= 0:
                Y[j] += float(G[j, k]) * V[c].double()
    return Y


def loop_scatter(V, idx, G, X, alpha):
    V = V.double().clone()
    m, K = idx.shape
    for j in range(m):
        for k in range(K):
            c = int(idx[j, k])
            if c >= 0:
                V[c] += alpha * float(G[j, k]) * X[j].double()
    return V


def dense_yd(idx, G, D):
    """The K-sparse m x D matrix Yd, built explicitly."""
    m, K = idx.shape
    Yd = torch.zeros(m, D, dtype=torch.float64)
    for j in range(m):
        for k in range(K):
            if idx[j, k] >= 0:
                Yd[j, idx[j, k]] += float(G[j, k])
    return Yd


# --- references against brute force -----------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_reference_gather_dot_matches_loop(shape):
    m, K, D, d = shape
    V, idx, G, X = make_case(m, K, D, d, "cpu")
    x0 = torch.randn(m)
    close(ref.gather_dot(V, idx, X, x0).double(), loop_gather_dot(V, idx, X, x0))
    close(ref.gather_dot(V, idx, X).double(), loop_gather_dot(V, idx, X, None))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_gather_sum_matches_loop(shape):
    V, idx, G, _ = make_case(*shape, "cpu")
    close(ref.gather_sum(V, idx, G).double(), loop_gather_sum(V, idx, G))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_scatter_matches_loop(shape):
    V, idx, G, X = make_case(*shape, "cpu")
    expected = loop_scatter(V, idx, G, X, -0.7)
    ref.scatter_add_rows_(V, idx, G, X, -0.7)
    close(V.double(), expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_sparse_gram_is_yd_yd_t(shape):
    m, K, D, d = shape
    _, idx, G, _ = make_case(m, K, D, d, "cpu")
    Yd = dense_yd(idx, G, D)
    close(ref.sparse_gram(idx, G).double(), Yd @ Yd.T)


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


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_m_matrix_is_dense_dO_dO_t(shape):
    m, K, D, d = shape
    s = factored_state(m, K, D, d)
    torch.testing.assert_close(s["Z"], (s["gs"][:, None] + s["Yd"]) @ s["W"])  # Z as in ALGORITHM.md
    yy = ref.sparse_gram(s["idx"], s["G"])
    M = ref.m_matrix(s["H"] @ s["Q"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, yy)
    torch.testing.assert_close(M, s["dO"] @ s["dO"].T)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("c", [1.0, 0.97])
def test_reference_q_update_is_gram_of_updated_w(shape, c):
    m, K, D, d = shape
    s = factored_state(m, K, D, d)
    lr = 0.05
    W_new = c * s["W"] - lr * s["dO"].T @ s["H"]
    Q_new = ref.q_update(s["Q"], s["H"], s["dO"] @ s["W"], s["dO"] @ s["dO"].T, lr, c)
    torch.testing.assert_close(Q_new, W_new.T @ W_new)


# --- Triton against the references ------------------------------------------

X_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_gather_dot(shape, x_dtype, device):
    m, K, D, d = shape
    V, idx, _, X = make_case(m, K, D, d, device, x_dtype)
    x0 = torch.randn(m, device=device).to(x_dtype)
    for args in ((V, idx, X, x0), (V, idx, X)):
        A = tri.gather_dot(*args)
        assert A.dtype == torch.float32
        close(A, ref.gather_dot(*args))
        assert (A[idx < 0] == 0).all()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("g_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_gather_sum(shape, g_dtype, device):
    V, idx, G, _ = make_case(*shape, device)
    G = G.to(g_dtype)
    G[idx < 0] = float("nan")  # padding slots must not be read
    Y = tri.gather_sum(V, idx, G)
    assert torch.isfinite(Y).all()
    close(Y, ref.gather_sum(V, idx, G))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_scatter_add_rows(shape, x_dtype, device):
    V, idx, G, X = make_case(*shape, device, x_dtype)
    V_tri, V_ref = V.clone(), V.clone()
    out = tri.scatter_add_rows_(V_tri, idx, G, X, 0.3)
    ref.scatter_add_rows_(V_ref, idx, G, X, 0.3)
    assert out is V_tri
    close(V_tri, V_ref)
    untouched = torch.ones(V.shape[0], dtype=torch.bool, device=device)
    untouched[idx[idx >= 0]] = False
    assert torch.equal(V_tri[untouched], V[untouched])  # rows not targeted keep their bits


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_scatter_is_deterministic_with_repeated_rows(device):
    m, K, D, d = 12, 2, 3, 133  # 24 slots on 3 rows: long runs of the same row
    V, idx, G, X = make_case(m, K, D, d, device)
    runs = []
    for _ in range(3):
        W = V.clone()
        tri.scatter_add_rows_(W, idx, G, X, 0.01)
        runs.append(W)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    close(runs[0], ref.scatter_add_rows_(V.clone(), idx, G, X, 0.01))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_scatter_alpha_on_device(device):
    V, idx, G, X = make_case(5, 2, 4, 37, device)
    a, b = V.clone(), V.clone()
    tri.scatter_add_rows_(a, idx, G, X, torch.tensor(-0.25, device=device))
    tri.scatter_add_rows_(b, idx, G, X, -0.25)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", SHAPES + [(40, 2, 30, 5)])  # m = 40: more than one tile
def test_triton_sparse_gram(shape, device):
    _, idx, G, _ = make_case(*shape, device)
    close(tri.sparse_gram(idx, G), ref.sparse_gram(idx, G))


def bookkeeping_inputs(m, d, K, D, device, h_dtype):
    s = factored_state(m, K, D, d)
    f32 = {k: v.to(device=device, dtype=torch.float32) if v.is_floating_point() else v.to(device)
           for k, v in s.items()}
    f32["H"] = f32["H"].to(h_dtype)
    f32["yy"] = ref.sparse_gram(f32["idx"], f32["G"])
    f32["Hq"] = f32["H"].float() @ f32["Q"]
    return f32


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("h_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(40, 2, 30, 5)])
def test_triton_m_matrix(shape, h_dtype, device):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, device, h_dtype)
    args = (s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    M = tri.m_matrix(*args)
    assert torch.equal(M, M.T)
    close(M, ref.m_matrix(*args), rtol=2e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("h_dtype", X_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(5, 1, 6, 70)])  # d = 70: more than one tile
def test_triton_q_update(shape, h_dtype, device):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, device, h_dtype)
    M = ref.m_matrix(s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    dH = torch.randn(m, d, device=device)
    for lr, c in ((0.05, 1.0), (0.05, 0.97), (torch.tensor(0.05, device=device), torch.tensor(0.97, device=device))):
        Q_new = tri.q_update(s["Q"], s["H"], dH, M, lr, c)
        assert torch.equal(Q_new, Q_new.T)
        close(Q_new, ref.q_update(s["Q"], s["H"], dH, M, lr, c), rtol=2e-5)


# --- bad input --------------------------------------------------------------

IMPLS = [pytest.param(ref, id="reference"), pytest.param(tri, id="triton")]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_raises_and_leaves_v_untouched(impl):
    device = KERNEL_DEVICES[0]
    V, idx, G, X = make_case(4, 2, 5, 8, device)
    before = V.clone()
    bad_calls = [
        (TypeError, lambda: impl.scatter_add_rows_(V, idx.float(), G, X, 0.1)),  # float indices
        (ValueError, lambda: impl.scatter_add_rows_(V, idx[0], G, X, 0.1)),  # 1-D idx
        (ValueError, lambda: impl.scatter_add_rows_(V, idx, G, X[:, :-1], 0.1)),  # X width != d
        (ValueError, lambda: impl.scatter_add_rows_(V, idx, G[:3], X, 0.1)),  # G rows != m
        (TypeError, lambda: impl.scatter_add_rows_(V, idx, G, X, "0.1")),
        (ValueError, lambda: impl.scatter_add_rows_(V, idx, G, X, torch.ones(2, device=device))),
        (ValueError, lambda: impl.gather_dot(V, idx, X, torch.zeros(3, device=device))),
        (TypeError, lambda: impl.gather_sum(V, idx, G.long())),
        (ValueError, lambda: impl.sparse_gram(idx[None], G)),
        (ValueError, lambda: impl.q_update(torch.eye(8, device=device), X, X, torch.eye(3, device=device), 0.1, 1.0)),
        (ValueError, lambda: impl.m_matrix(X, X, X, G[:, 0], G[:, 0], G[:, 0], 0, torch.eye(4, device=device))),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
    assert torch.equal(V, before)


def test_package_functions_survive_importing_the_kernels():
    import lst_kernels
    from lst_kernels import dispatch

    for name in ("gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "m_matrix", "q_update"):
        assert getattr(lst_kernels, name) is getattr(dispatch, name)


# --- the plain-torch fast path used off CUDA ----------------------------------

@pytest.mark.parametrize("shape", SHAPES + [(40, 2, 30, 5)])
def test_torch_ops_bookkeeping_match_reference(shape):
    from lst_kernels import torch_ops

    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, "cpu", torch.float32)
    args = (s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    M = torch_ops.m_matrix(*args)
    close(M, ref.m_matrix(*args), rtol=2e-5)
    dH = torch.randn(m, d)
    for lr, c in ((0.05, 1.0), (0.05, 0.97)):
        close(torch_ops.q_update(s["Q"], s["H"], dH, M, lr, c), ref.q_update(s["Q"], s["H"], dH, M, lr, c),
              rtol=2e-5)
