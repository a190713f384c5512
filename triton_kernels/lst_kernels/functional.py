"""The sparse ops of the factored head: one public function per op.

Each function checks its arguments first (``checks.py``: bad input raises TypeError/ValueError
before anything runs or changes), then calls the implementation ``ops.ops_for`` chooses for the
tensors' device: the Triton one (``triton_ops.py``: the launchers of ``<op>_kernel(s).py``) for
CUDA tensors when Triton is importable, the plain-torch one (``ops.TORCH``: ``reference.py``'s
three sparse ops, ``torch_ops.py``'s others) otherwise. ``impl`` forces the choice ("torch",
"triton"; "auto" also honours ``LST_KERNELS=torch``). A function here is its checks and that
call, nothing more: the implementations are the ones ``ops_for`` hands a caller that chooses
once (the factored head's step: ``StepPlan.kernels``). ``SortedIds.of(idx)`` is the one sort of a
step's ids that ``gram_rows``, the scatter inside it and the write's ``scatter_add_rows_`` can
share (``order=``): one device sort instead of three, the same bits.

Index values are not range-checked here (that needs a host sync): padding is -1, and every
implementation skips any index outside [0, D) as padding (the gathers give 0 for it, the scatter
writes nothing for it).

Shapes: ``V`` (D, d); ``idx`` (m, K) int64 or int32, -1 for padding; ``G`` (m, K);
``X``, ``H`` (m, d); ``Q`` (d, d); ``M`` (m, m).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .checks import positive_int, scalar, tensor, written
from .ops import Ops, ops_for
from .torch_ops import SortedIds


def _order(order: object, n: int) -> SortedIds:
    """``order`` as the SortedIds of n ids (its type and shapes; that it sorts this op's ids is
    the caller's word: checking it would read the device)."""
    if not isinstance(order, SortedIds):
        raise TypeError(f"order must be lst_kernels.SortedIds (SortedIds.of(idx)), got {type(order).__name__}")
    tensor("order.keys", order.keys, (n,), index=True)
    tensor("order.perm", order.perm, (n,), index=True)
    return order


def _ops(impl: str, first: Tensor, *others) -> Ops:
    """The implementation for these tensors, all on one device, and ``impl`` (``ops.ops_for``)."""
    for t in others:
        if isinstance(t, Tensor) and t.device != first.device:
            raise ValueError(f"tensors must be on one device, got {first.device} and {t.device}")
    return ops_for(first.device, impl)


def gather_dot(V: Tensor, idx: Tensor, X: Tensor, x0: Tensor | None = None, *, impl: str = "auto") -> Tensor:
    """A[j, k] = X[j] . V[idx[j, k]] + x0[j]; padding slots give 0. (m, K)."""
    d = tensor("V", V, (None, None)).shape[1]
    m = tensor("idx", idx, (None, None), index=True).shape[0]
    tensor("X", X, (m, d))
    if x0 is not None:
        tensor("x0", x0, (m,))
    return _ops(impl, V, idx, X, x0).gather_dot(V, idx, X, x0)


def gather_sum(V: Tensor, idx: Tensor, G: Tensor, *, impl: str = "auto") -> Tensor:
    """Y[j] = sum_k G[j, k] V[idx[j, k]] (padding ignored): Yd V. (m, d)."""
    tensor("V", V, (None, None))
    tensor("G", G, tuple(tensor("idx", idx, (None, None), index=True).shape))
    return _ops(impl, V, idx, G).gather_sum(V, idx, G)


def scatter_add_rows_(V: Tensor, idx: Tensor, G: Tensor, X: Tensor, alpha: float | Tensor, *,
                      order: SortedIds | None = None, impl: str = "auto") -> Tensor:
    """V[idx[j, k]] += alpha G[j, k] X[j] in place, repeated rows summed in batch order
    (deterministic, no float atomics); ``alpha`` may be a device scalar (CUDA graphs).
    ``order``: ``SortedIds.of(idx)`` made already (sorted here otherwise)."""
    d = tensor("V", V, (None, None)).shape[1]
    m, K = tensor("idx", idx, (None, None), index=True).shape
    tensor("G", G, (m, K))
    tensor("X", X, (m, d))
    scalar("alpha", alpha)
    written("V", V)
    if order is not None:
        _order(order, m * K)
    return _ops(impl, V, idx, G, X, alpha, *(order or ())).scatter_add_rows_(V, idx, G, X, alpha, order)


def fold_rows_(V: Tensor, M: Tensor, flag: Tensor | bool, *, impl: str = "auto") -> Tensor:
    """V <- V M in place where ``flag`` (a bool or a one-element tensor) is true, else nothing;
    returns V. The flag is read on the device: a step under device flags folds a nearly
    singular update into V with no host read (the Triton kernel on CUDA; the CPU's
    implementation reads its CPU flag, where nothing waits: ``torch_ops.fold_rows_``).
    O(D d^2) where the flag is set; one load a program where it is not."""
    d = tensor("V", V, (None, None)).shape[1]
    tensor("M", M, (d, d))
    if isinstance(flag, bool):
        flag = torch.tensor(flag, device=V.device)
    elif not isinstance(flag, Tensor) or flag.numel() != 1 or flag.is_floating_point():
        raise TypeError(f"flag must be a bool or a one-element bool or integer tensor, got {flag!r}")
    written("V", V)
    return _ops(impl, V, M, flag).fold_rows_(V, M, flag)


def sparse_gram(idx: Tensor, G: Tensor, *, impl: str = "auto") -> Tensor:
    """The m x m Yd Yd^T: sum over k, l of G[i, k] G[j, l] [idx[i, k] == idx[j, l] != -1]."""
    tensor("G", G, tuple(tensor("idx", idx, (None, None), index=True).shape))
    return _ops(impl, idx, G).sparse_gram(idx, G)


def gram_rows(idx: Tensor, G: Tensor, X: Tensor, *, order: SortedIds | None = None, impl: str = "auto") -> Tensor:
    """Yd Yd^T X (m, d) in O(m K d) plus a sort of the m K ids (``order``: made already), never
    the m x m Yd Yd^T: the slots coalesced to their distinct columns (static shapes: no host
    sync, CUDA graphs capture it), N = Yd^T X on them, then Yd N (on CUDA by the deterministic
    scatter and gather kernels, no float atomics)."""
    m, K = tensor("idx", idx, (None, None), index=True).shape
    tensor("G", G, (m, K))
    tensor("X", X, (m, None))
    if order is not None:
        _order(order, m * K)
    return _ops(impl, X, idx, G, *(order or ())).gram_rows(idx, G, X, order)


def m_matrix(Hq: Tensor, H: Tensor, Z: Tensor, gq: Tensor, gs: Tensor, ybar: Tensor,
             num_classes: int, yy: Tensor, *, impl: str = "auto") -> Tensor:
    """M = dO dO^T (m x m) from its factors: ``Hq = H Q``, ``Z = (g_s 1^T + Yd) W``,
    ``ybar = rowsum(G_A)``, ``yy = Yd Yd^T``, ``num_classes = D``."""
    m, d = tensor("H", H, (None, None)).shape
    tensor("Hq", Hq, (m, d))
    tensor("Z", Z, (m, d))
    tensor("gq", gq, (m,))
    tensor("gs", gs, (m,))
    tensor("ybar", ybar, (m,))
    tensor("yy", yy, (m, m))
    positive_int("num_classes", num_classes)
    return _ops(impl, H, Hq, Z, gq, gs, ybar, yy).m_matrix(Hq, H, Z, gq, gs, ybar, num_classes, yy)


def q_update(Q: Tensor, H: Tensor, dH: Tensor, M: Tensor, lr: float | Tensor, c: float | Tensor, *,
             impl: str = "auto") -> Tensor:
    """Q_new = c^2 Q - c lr (dH^T H + H^T dH) + lr^2 H^T M H, a new (d, d) tensor: W_new^T W_new
    for W_new = c W - lr dO^T H when Q = W^T W, dH = dO W and M = dO dO^T (symmetric)."""
    m, d = tensor("H", H, (None, None)).shape
    tensor("Q", Q, (d, d))
    tensor("dH", dH, (m, d))
    tensor("M", M, (m, m))
    scalar("lr", lr)
    scalar("c", c)
    return _ops(impl, Q, H, dH, M, lr, c).q_update(Q, H, dH, M, lr, c)


def q_update_factors(Q: Tensor, H: Tensor, gq: Tensor, Z: Tensor, gs: Tensor, ybar: Tensor, num_classes: int,
                     YYH: Tensor, lr: float | Tensor, c: float | Tensor, *, P: Tensor | None = None,
                     Gq: Tensor | None = None, HYYH: Tensor | None = None, GqP: Tensor | None = None,
                     impl: str = "auto") -> Tensor:
    """``q_update`` without the m x m M: Q_new from d x d products of the step's factors,
    ``Z = (g_s 1^T + Yd) W`` and ``YYH = Yd Yd^T H`` (``gram_rows``). 3 m d^2 + 2 d^3
    multiply-adds (4 d^3 with ``P``; one m d^2 fewer with ``Gq``) against 3 m^2 d + m d^2 for
    ``m_matrix`` and ``q_update``: the cheaper route from m ~ d. ``P`` (d, d), symmetric: the step W_new = c W - lr dO^T H P
    (a right preconditioner), Q_new = c^2 Q - c lr (P E + E^T P) + lr^2 P H^T M H P with
    E = H^T dH; None: P = I. ``Gq`` (d, d): G = H^T diag(g_q) H made already (the step forms it
    once: m d^2 fewer here), else made here. ``HYYH`` (d, d): a further part of H^T Yd Yd^T H
    given whole (the shared negatives' block, N^T N), added to H^T YYH. ``GqP``: G P made already
    (with ``P``: d^3 fewer), an argument of this fused form only. torch on every device (``impl``
    is checked, no kernel of its own)."""
    m, d = tensor("H", H, (None, None)).shape
    tensor("Q", Q, (d, d))
    for name, t in (("Z", Z), ("YYH", YYH)):
        tensor(name, t, (m, d))
    for name, t in (("gq", gq), ("gs", gs), ("ybar", ybar)):
        tensor(name, t, (m,))
    positive_int("num_classes", num_classes)
    scalar("lr", lr)
    scalar("c", c)
    for name, t in (("P", P), ("Gq", Gq), ("GqP", GqP), ("HYYH", HYYH)):
        if t is not None:
            tensor(name, t, (d, d))
    ops = _ops(impl, Q, H, gq, Z, gs, ybar, YYH, P, Gq, GqP, HYYH)
    return ops.q_update_factors(Q, H, gq, Z, gs, ybar, num_classes, YYH, lr, c, P=P, Gq=Gq, HYYH=HYYH, GqP=GqP)


def logsumexp_rows(Z: Tensor, *, with_softmax: bool = False, impl: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """log sum_j exp(Z[i, j]) per row of a floating (m, n) Z, n >= 1: (m, 1), differentiable,
    -inf entries (masked slots) taking no mass. The sampled softmaxes' normaliser (the exact
    head's ``loss="sampled"``, the sampled softmax baseline, the hierarchical softmax's
    row-sparse training). Not ``torch.logsumexp``: on the CPU its exp, and its gradient's
    ``exp(Z - lse)``, take a slow path for every shifted entry below about -87 (float32's
    smallest normal), 12x at 256 x 65 once a model's outputs spread that far
    (docs/kernels.md); the softmax kernel does not.
    ``with_softmax``: (the normaliser, softmax(Z)) outside autograd, for a loss whose
    gradient is written in closed form. torch on every device (``impl`` is checked, no
    kernel of its own)."""
    if not isinstance(Z, Tensor):
        raise TypeError(f"Z must be a torch.Tensor, got {type(Z).__name__}")
    if not Z.is_floating_point() or Z.dim() != 2 or Z.shape[1] < 1:
        raise ValueError(f"Z must be a floating (m, n) tensor with n >= 1, got {Z.dtype} {tuple(Z.shape)}")
    if not isinstance(with_softmax, bool):
        raise TypeError(f"with_softmax must be a bool, got {with_softmax!r}")
    return _ops(impl, Z).logsumexp_rows(Z, with_softmax)
