"""The public ops (functional.py): each checks its arguments before anything runs, calls the
implementation ``ops_for`` chooses, and its torch path equals the term-by-term reference."""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
from kernel_cases import KERNEL_DEVICES, SHAPES, TILED_SHAPE, bookkeeping_inputs, close, factored_state, make_case

import lst_kernels
from lst_kernels import _launch, functional, ops, reference

OPS = ("gather_dot", "gather_sum", "scatter_add_rows_", "sparse_gram", "gram_rows", "m_matrix", "q_update",
       "q_update_factors", "logsumexp_rows", "fold_rows_")


#: the ops that sort the step's ids, and can take that sort made once (``order=``, keyword-only)
SORTING = ("scatter_add_rows_", "gram_rows")
#: the ops that take a product the step made already, keyword-only, beyond the reference's arguments
MADE = {"q_update_factors": ["GqP"]}


def test_every_op_is_one_public_function_with_the_reference_signature_and_impl():
    assert set(OPS) == {n for n in lst_kernels.__all__ if n not in ("reference", "SortedIds", "Ops", "ops_for")}
    for name in OPS:
        op = getattr(lst_kernels, name)
        assert op is getattr(functional, name), name
        params = inspect.signature(op).parameters
        own = (["order"] if name in SORTING else []) + MADE.get(name, []) + ["impl"]
        assert list(params)[-len(own):] == own, name
        assert list(params)[:-len(own)] == list(inspect.signature(getattr(reference, name)).parameters), name
        for p in own:
            assert params[p].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["impl"].default == "auto" and (name not in SORTING or params["order"].default is None)
        assert all(params[p].default is None for p in MADE.get(name, []))


@pytest.mark.parametrize("shape", SHAPES + [(24, 3, 4, 5)])
def test_sorted_ids_are_the_stable_sort_of_the_flat_ids(shape):
    m, K, D, d = shape
    _, idx, _, _ = make_case(m, K, D, d, "cpu")
    keys, perm = lst_kernels.SortedIds.of(idx.int())
    flat = idx.reshape(-1)
    assert keys.dtype == perm.dtype == torch.int64 and torch.equal(keys, flat[perm])
    assert bool((keys[1:] >= keys[:-1]).all())
    same = keys[1:] == keys[:-1]
    assert bool((perm[1:][same] > perm[:-1][same]).all())  # equal ids in batch order


def test_a_bad_order_is_refused_and_changes_nothing():
    V, idx, G, X = make_case(6, 2, 9, 5, "cpu")
    before = V.clone()
    keys, perm = lst_kernels.SortedIds.of(idx)
    for bad, err, match in [((keys, perm), TypeError, "order must be lst_kernels.SortedIds"),
                            (lst_kernels.SortedIds(keys[:-1], perm[:-1]), ValueError, r"order.keys must have shape \(12,\)"),
                            (lst_kernels.SortedIds(keys, perm.float()), TypeError, "order.perm must be int64 or int32")]:
        with pytest.raises(err, match=match):
            lst_kernels.scatter_add_rows_(V, idx, G, X, 0.5, order=bad)
        with pytest.raises(err, match=match):
            lst_kernels.gram_rows(idx, G, X, order=bad)
    assert torch.equal(V, before)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_complex_alpha_a_leaf_that_requires_grad_and_a_word_for_a_bool_are_refused(impl):
    """Each in one line before anything runs, the same on both implementations (the torch path
    dropped a complex alpha's imaginary part, Triton failed in its launcher; the Triton scatter wrote
    into a leaf that requires grad, which torch's ``index_add_`` refuses; ``with_softmax="yes"`` was
    taken as true)."""
    if impl == "triton" and not ops._TRITON_IMPORTABLE:
        pytest.skip("the Triton path needs triton (a Linux x86-64 dependency)")
    V, idx, G, X = make_case(6, 2, 9, 5, "cpu")
    before = V.clone()
    with pytest.raises(TypeError, match="alpha must be a real number") as err:
        lst_kernels.scatter_add_rows_(V, idx, G, X, torch.tensor(0.5 + 1j), impl=impl)
    leaf = V.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="V is a leaf that requires grad") as err2:
        lst_kernels.scatter_add_rows_(leaf, idx, G, X, 0.5, impl=impl)
    with pytest.raises(RuntimeError, match="V is a leaf that requires grad"):
        lst_kernels.fold_rows_(leaf, torch.eye(5), True, impl=impl)
    with pytest.raises(TypeError, match="with_softmax must be a bool"):
        lst_kernels.logsumexp_rows(X, with_softmax="yes", impl=impl)
    assert "\n" not in str(err.value) + str(err2.value)
    assert torch.equal(V, before) and torch.equal(leaf.detach(), before)


def test_an_unknown_impl_or_tensors_on_two_devices_are_refused():
    V, idx, G, X = make_case(6, 2, 9, 5, "cpu")
    with pytest.raises(ValueError, match="impl must be one of"):
        lst_kernels.gather_sum(V, idx, G, impl="cuda")
    with pytest.raises(ValueError, match="tensors must be on one device"):
        lst_kernels.gather_sum(V, idx, G.to("meta"))
    # a sort of the ids made on another device (a GPU kernel would read its pointers as its own)
    order = lst_kernels.SortedIds(*(t.to("meta") for t in lst_kernels.SortedIds.of(idx)))
    before = V.clone()
    with pytest.raises(ValueError, match="tensors must be on one device"):
        lst_kernels.scatter_add_rows_(V, idx, G, X, 0.5, order=order)
    with pytest.raises(ValueError, match="tensors must be on one device"):
        lst_kernels.gram_rows(idx, G, X, order=order)
    assert torch.equal(V, before)


@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_torch_bookkeeping_matches_the_reference(shape):
    m, K, D, d = shape
    s = bookkeeping_inputs(m, d, K, D, "cpu")
    args = (s["Hq"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D, s["yy"])
    M = lst_kernels.m_matrix(*args, impl="torch")
    close(M, reference.m_matrix(*args), rtol=2e-5)
    dH = torch.randn(m, d)
    for lr, c in ((0.05, 1.0), (0.05, 0.97), (torch.tensor(0.05), torch.tensor(0.97))):
        close(lst_kernels.q_update(s["Q"], s["H"], dH, M, lr, c, impl="torch"),
              reference.q_update(s["Q"], s["H"], dH, M, lr, c), rtol=2e-5)


@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE, (24, 3, 4, 5)])
def test_gram_rows_matches_the_reference(shape):
    """Coalesced by a sort (repeats within a row and across rows, padding anywhere) against
    the m x m Yd Yd^T times X; (24, 3, 4, 5): every class repeated many times."""
    m, K, D, d = shape
    _, idx, G, X = make_case(m, K, D, d, "cpu")
    G = G.double()
    close(lst_kernels.gram_rows(idx, G, X.double(), impl="torch"), reference.gram_rows(idx, G, X.double()))


@pytest.mark.skipif(not ops._TRITON_IMPORTABLE, reason="the Triton path needs triton (a Linux x86-64 dependency)")
@pytest.mark.parametrize("shape", SHAPES + [(12, 3, 4, 5)])
def test_gram_rows_through_the_triton_scatter_and_gather(shape):
    m, K, D, d = shape
    V, idx, G, X = make_case(m, K, D, d, KERNEL_DEVICES[0])
    out = lst_kernels.gram_rows(idx, G, X, impl="triton")
    close(out.double().cpu(), reference.gram_rows(idx.cpu(), G.double().cpu(), X.double().cpu()), rtol=2e-5)
    # the step's one sort of the ids handed in: the same bits (its scatter then sorts nothing)
    assert torch.equal(lst_kernels.gram_rows(idx, G, X, order=lst_kernels.SortedIds.of(idx), impl="triton"), out)


@pytest.mark.skipif(not ops._TRITON_IMPORTABLE, reason="the Triton path needs triton (a Linux x86-64 dependency)")
@pytest.mark.parametrize("shape", SHAPES + [(12, 3, 4, 5)])
def test_the_triton_scatter_with_the_sort_handed_in_gives_the_same_bits(shape):
    m, K, D, d = shape
    V, idx, G, X = make_case(m, K, D, d, KERNEL_DEVICES[0])
    own, handed = V.clone(), V.clone()
    lst_kernels.scatter_add_rows_(own, idx, G, X, -0.3, impl="triton")
    lst_kernels.scatter_add_rows_(handed, idx, G, X, -0.3, order=lst_kernels.SortedIds.of(idx), impl="triton")
    assert torch.equal(own, handed)
    close(handed, reference.scatter_add_rows_(V.clone(), idx, G, X, -0.3))


@pytest.mark.parametrize("shape", SHAPES + [TILED_SHAPE])
def test_q_update_factors_matches_the_reference_and_the_m_route(shape):
    """The fused d x d form against its term-by-term reference, and both against Q's update
    through M (the route they replace where m > d), in float64."""
    m, K, D, d = shape
    s = factored_state(m, K, D, d)
    YYH = reference.gram_rows(s["idx"], s["G"], s["H"])
    dH = 2 * s["gq"][:, None] * (s["H"] @ s["Q"]) + s["Z"]
    M = reference.m_matrix(s["H"] @ s["Q"], s["H"], s["Z"], s["gq"], s["gs"], s["ybar"], D,
                           reference.sparse_gram(s["idx"], s["G"]))
    for lr, c in ((0.05, 1.0), (0.05, 0.97), (torch.tensor(0.05), torch.tensor(0.97))):
        args = (s["Q"], s["H"], s["gq"], s["Z"], s["gs"], s["ybar"], D, YYH, lr, c)
        fused = lst_kernels.q_update_factors(*args, impl="torch")
        close(fused, reference.q_update_factors(*args))
        close(fused, reference.q_update(s["Q"], s["H"], dH, M, lr, c))
        # a right preconditioner P: the M route with H P on the update's side
        A = torch.randn(d, d, dtype=s["H"].dtype)
        P = A @ A.T / d + torch.eye(d, dtype=A.dtype)
        fused = lst_kernels.q_update_factors(*args, P=P, impl="torch")
        close(fused, reference.q_update_factors(*args, P=P))
        close(fused, reference.q_update(s["Q"], s["H"] @ P, dH, M, lr, c))
        # H^T diag(g_q) H given, and a part of H^T Yd Yd^T H given whole (the rows' part then 0)
        Gq = s["H"].T @ (s["gq"][:, None] * s["H"])
        given = (*args[:7], torch.zeros_like(YYH), lr, c)
        for right in (None, P):
            GqP = None if right is None else Gq @ right
            fused = lst_kernels.q_update_factors(*given, P=right, Gq=Gq, GqP=GqP, HYYH=s["H"].T @ YYH, impl="torch")
            close(fused, reference.q_update_factors(*given, P=right, Gq=Gq, HYYH=s["H"].T @ YYH))
            close(fused, reference.q_update_factors(*args, P=right))


IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not ops._TRITON_IMPORTABLE, reason="the Triton path needs triton (a Linux x86-64 dependency)"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m,K", [(0, 3), (3, 0)])
def test_an_empty_batch_gives_empty_or_zero_outputs(impl, m, K):
    """No rows (m = 0) or no slots (K = 0): every sparse op on either path, outputs of the shapes of a
    non-empty batch (zeros where they are sums over no slots), V unchanged."""
    device = KERNEL_DEVICES[0]
    V, X = torch.randn(5, 4, device=device), torch.randn(m, 4, device=device)
    idx, G = torch.zeros(m, K, dtype=torch.int64, device=device), torch.randn(m, K, device=device)
    op = {name: functools.partial(getattr(lst_kernels, name), impl=impl) for name in OPS}
    assert op["gather_dot"](V, idx, X).shape == (m, K)
    for out in (op["gather_sum"](V, idx, G), op["gram_rows"](idx, G, X)):
        assert torch.equal(out, torch.zeros(m, 4, device=device))
    assert torch.equal(op["sparse_gram"](idx, G), torch.zeros(m, m, device=device))
    W = V.clone()
    op["scatter_add_rows_"](W, idx, G, X, 0.5)
    assert torch.equal(W, V)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_id_outside_the_classes_is_skipped_as_padding(impl):
    """Ids are not range-checked (a host read): an id at D or beyond, or below -1, is padding on either
    path, as the kernels skip it (the torch scatter wrote the other rows, then raised)."""
    device = KERNEL_DEVICES[0]
    V, idx, G, X = make_case(4, 2, 5, 8, device)
    idx[0, 0], idx[1, 1], idx[2, 0] = 5, 7, -3
    padded = torch.where((idx >= 0) & (idx < 5), idx, -1)
    op = {name: functools.partial(getattr(lst_kernels, name), impl=impl) for name in OPS}
    assert torch.equal(op["gather_dot"](V, idx, X), op["gather_dot"](V, padded, X))
    assert torch.equal(op["gather_sum"](V, idx, G), op["gather_sum"](V, padded, G))
    W, W_padded = V.clone(), V.clone()
    op["scatter_add_rows_"](W, idx, G, X, 0.5)
    op["scatter_add_rows_"](W_padded, padded, G, X, 0.5)
    assert torch.equal(W, W_padded)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_raises_and_leaves_v_untouched(impl):
    device = KERNEL_DEVICES[0]
    V, idx, G, X = make_case(4, 2, 5, 8, device)
    before = V.clone()
    op = {name: functools.partial(getattr(lst_kernels, name), impl=impl) for name in OPS}
    bad_calls = [
        (TypeError, lambda: op["scatter_add_rows_"](V, idx.float(), G, X, 0.1)),  # float indices
        (ValueError, lambda: op["scatter_add_rows_"](V, idx[0], G, X, 0.1)),  # 1-D idx
        (ValueError, lambda: op["scatter_add_rows_"](V, idx, G, X[:, :-1], 0.1)),  # X width != d
        (ValueError, lambda: op["scatter_add_rows_"](V, idx, G[:3], X, 0.1)),  # G rows != m
        (TypeError, lambda: op["scatter_add_rows_"](V, idx, G, X, "0.1")),
        (ValueError, lambda: op["scatter_add_rows_"](V, idx, G, X, torch.ones(2, device=device))),
        (ValueError, lambda: op["scatter_add_rows_"](V, idx.to("meta"), G, X, 0.1)),  # two devices
        (ValueError, lambda: op["gather_dot"](V, idx, X, torch.zeros(3, device=device))),
        (TypeError, lambda: op["gather_sum"](V, idx, G.long())),
        (ValueError, lambda: op["sparse_gram"](idx[None], G)),
        (ValueError, lambda: op["q_update"](torch.eye(8, device=device), X, X, torch.eye(3, device=device), 0.1, 1.0)),
        (ValueError, lambda: op["m_matrix"](X, X, X, G[:, 0], G[:, 0], G[:, 0], 0, torch.eye(4, device=device))),
        (ValueError, lambda: op["gram_rows"](idx, G, X[:-1])),
        (ValueError, lambda: op["q_update_factors"](torch.eye(8, device=device), X, G[:, 0], X, G[:, 0], G[:, 0], 5,
                                                    X[:-1], 0.1, 1.0)),
        (ValueError, lambda: op["q_update_factors"](torch.eye(8, device=device), X, G[:, 0], X, G[:, 0], G[:, 0], 5,
                                                    X, 0.1, 1.0, Gq=torch.eye(7, device=device))),
        (ValueError, lambda: lst_kernels.gather_sum(V, idx, G, impl="cuda")),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
    assert torch.equal(V, before)


@pytest.mark.parametrize("K,want", [(1, 2), (2, 2), (3, 4), (8, 8), (9, 16), (16, 16), (17, 16), (1000, 16)])
def test_block_k_is_the_next_power_of_two_within_bounds(K, want):
    assert _launch.block_k(K) == want


def test_tiles():
    assert _launch.tile(4096, 4) == 64 and _launch.tile(4096, 8) == 32 and _launch.tile(512, 2) == 32
