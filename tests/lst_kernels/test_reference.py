"""The plain-torch references against brute-force loops and dense algebra."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import SHAPES, close, dense_yd, factored_state, make_case

from lst_kernels import reference as ref


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


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_m_matrix_is_dense_dO_dO_t(shape):
    m, K, D, d = shape
    s = factored_state(m, K, D, d)
    torch.testing.assert_close(s["Z"], (s["gs"][:, None] + s["Yd"]) @ s["W"])  # Z as in docs/algorithm.md
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


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_gram_rows_is_yd_yd_t_x(shape):
    m, K, D, d = shape
    _, idx, G, X = make_case(m, K, D, d, "cpu")
    Yd = dense_yd(idx, G, D)
    close(ref.gram_rows(idx, G, X).double(), Yd @ Yd.T @ X.double())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("c", [1.0, 0.97])
def test_reference_q_update_factors_is_gram_of_updated_w(shape, c):
    """Without M: the same W_new^T W_new from H, Z and Yd Yd^T H (every term of dO: the Gram
    of the updated W would miss any one of them)."""
    m, K, D, d = shape
    s = factored_state(m, K, D, d)
    lr = 0.05
    W_new = c * s["W"] - lr * s["dO"].T @ s["H"]
    YYH = s["Yd"] @ s["Yd"].T @ s["H"]
    Q_new = ref.q_update_factors(s["Q"], s["H"], s["gq"], s["Z"], s["gs"], s["ybar"], D, YYH, lr, c)
    torch.testing.assert_close(Q_new, W_new.T @ W_new)
    # with a right preconditioner (a symmetric positive definite d x d P): W_new = c W - lr dO^T H P
    A = torch.randn(d, d, dtype=s["H"].dtype)
    P = A @ A.T / d + torch.eye(d, dtype=A.dtype)
    W_new = c * s["W"] - lr * s["dO"].T @ s["H"] @ P
    Q_new = ref.q_update_factors(s["Q"], s["H"], s["gq"], s["Z"], s["gs"], s["ybar"], D, YYH, lr, c, P=P)
    torch.testing.assert_close(Q_new, W_new.T @ W_new)
    # H^T diag(g_q) H given (Gq), and H^T Yd Yd^T H given in two parts: the even columns of Yd
    # by rows (YYH), the odd ones whole (HYYH, d x d)
    even = (torch.arange(D) % 2 == 0).to(s["Yd"].dtype)
    Ye, Yo = s["Yd"] * even, s["Yd"] * (1 - even)
    Gq = s["H"].T @ (s["gq"][:, None] * s["H"])
    HYYH = s["H"].T @ Yo @ Yo.T @ s["H"]
    Q_new = ref.q_update_factors(s["Q"], s["H"], s["gq"], s["Z"], s["gs"], s["ybar"], D, Ye @ Ye.T @ s["H"], lr, c,
                                 P=P, Gq=Gq, HYYH=HYYH)
    torch.testing.assert_close(Q_new, W_new.T @ W_new)
