"""Sampled classes as slots of the exact step (docs/algorithm.md, "Sampled classes").

The exact update needs only ``dO = 2 diag(g_q) O + g_s 1^T + Yd`` with ``Yd`` sparse. A
sampled-softmax term over each row's targets and S sampled classes adds one column of ``Yd`` per
sampled class, so a loss = sampled-softmax CE + spherical terms (``losses/sampled_composite.py``)
takes the exact SGD step on the whole implicit W in O(m d^2 + m S d), with the same V, U, Q, wbar,
omega. Here: ``Negatives`` (the settings), ``NegativeSampling`` (``head.negatives``, both heads:
the proposal, a static table; the head's own generator, in its extra state; the slots' correction
and accidental-hit mask), the draw's two modes, settled when the head is made and held by the
step's plan (``plan.slots``): ``SharedDraw`` (negatives shared by the batch: the draw, and for the
factored head the loss and its gradients, its part a ``SharedBlock``, one dense block) and
``PerRowDraw`` (drawn per row: its part ``PerRowSlots``, extra slots of the general path). The
step (exact_step.py) enters this module only when the head has negatives.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

import lst_kernels as lk

from ..heads.kernel_functions import QUADRATIC_ALPHA
from ..heads.samplers import STATIC_SAMPLERS
from ..heads.targets import first_occurrence
from ..losses import SampledSlots
from .exact_step import TargetsOnly
from ..heads.settings import settings_from

SAMPLER_NAMES = tuple(STATIC_SAMPLERS)
RFF_REFUSAL = ("the RF-softmax proposal is not drawn for the implicit W = V U + 1 omega^T: its kernel is on "
               "w_c / ||w_c||, whose norm moves with U for every class at every step (a tree over it is O(D d^2) "
               "a step), and one over V's rows would draw a law of the factors, not of W, that the naive "
               "reference cannot draw; use a static sampler")
QUADRATIC_REFUSAL = ("the quadratic kernel's proposal is not drawn by the spherical heads: its sum-tree walk costs "
                     "thousands of the default's steps (docs/choosing_a_head.md); use a static sampler "
                     "(the sampled softmax keeps it: head=sampled_quadratic)")


@dataclass(frozen=True)
class Negatives:
    """The sampled classes of each training step, validated on construction.

    ``num``: S negatives (None: S for D, ``heads.samplers.default_num_samples``); ``sampler``:
    "log_uniform" (Zipf over frequency-sorted ids), "unigram" (``class_counts ** power``, +
    ``smoothing``), or "uniform" ("quadratic" and "rff" are refused, each in one line saying why);
    ``shared``: one draw for the whole batch (one dense block) or S per row; ``seed``:
    of the head's own generator (None: the head's init seed); ``remove_accidental_hits``: a
    negative equal to one of its row's targets is masked out (and the correction uses the
    law it was drawn from, q / (1 - q_T), q_T of that row). ``alpha`` and ``leaf_size`` are
    validated and recorded with the settings (a checkpoint's), and draw nothing."""

    num: int | None = None
    sampler: str = "log_uniform"
    shared: bool = True
    seed: int | None = None
    remove_accidental_hits: bool = True
    power: float = 0.75
    smoothing: float = 0.0
    alpha: float = QUADRATIC_ALPHA
    leaf_size: int | None = None
    class_counts: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.num is not None and (isinstance(self.num, bool) or not isinstance(self.num, int) or self.num < 1):
            raise ValueError(f"negatives.num must be a positive int or None (the loss's choice for D), "
                             f"got {self.num!r}")
        if self.sampler == "rff":
            raise ValueError(f"negatives.sampler='rff': {RFF_REFUSAL}")
        if self.sampler == "quadratic":
            raise ValueError(f"negatives.sampler='quadratic': {QUADRATIC_REFUSAL}")
        if self.sampler not in SAMPLER_NAMES:
            raise ValueError(f"negatives.sampler must be one of {sorted(SAMPLER_NAMES)}, got {self.sampler!r}")
        number = isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
        if not (number and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"negatives.alpha must be a finite number > 0, got {self.alpha!r}")
        if self.leaf_size is not None and (isinstance(self.leaf_size, bool) or not isinstance(self.leaf_size, int)
                                           or self.leaf_size < 1):
            raise ValueError(f"negatives.leaf_size must be a positive int or None, got {self.leaf_size!r}")
        if self.sampler == "unigram" and self.class_counts is None:
            raise ValueError("negatives.sampler='unigram' needs negatives.class_counts (one count per class)")
        for name in ("shared", "remove_accidental_hits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"negatives.{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"negatives.seed must be an int or None, got {self.seed!r}")

    @classmethod
    def of(cls, value) -> "Negatives | None":
        """The settings from a Negatives, a dict of some of its fields (a Hydra config), or None (off)."""
        return None if value is None else settings_from(cls, value, "negatives")

    def public(self) -> dict:
        """The settings but the counts (what a checkpoint records and compares)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "class_counts"}

    @classmethod
    def saved(cls, settings: dict) -> dict:
        """A checkpoint's settings, with the defaults of those it predates (alpha, leaf_size)."""
        return {**{f.name: f.default for f in dataclasses.fields(cls) if f.name != "class_counts"}, **settings}


def _state_bytes(generator: torch.Generator) -> bytes:
    """A generator's state as plain bytes (no tensor to share with another process)."""
    return generator.get_state().numpy().tobytes()


def _generator_of(device: torch.device, state: bytes) -> torch.Generator:
    """A generator of ``device`` at the state ``_state_bytes`` gave."""
    generator = torch.Generator(device=device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


class NegativeSampling:
    """``head.negatives``: the proposal, the head's generator and the draw (by its ``mode``)."""

    def __init__(self, settings: Negatives, num_classes: int, seed: int):
        self.settings = settings
        kw = {"class_counts": settings.class_counts, "power": settings.power,
              "smoothing": settings.smoothing} if settings.sampler == "unigram" else {}
        with torch.device("cpu"):  # tables on the host, also under a ``with torch.device("meta")`` build
            self.sampler = STATIC_SAMPLERS[settings.sampler](num_classes=num_classes, **kw)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(settings.seed if settings.seed is not None else seed)
        #: the generator of the device the draws run on since ``draw_on`` (None: on the host)
        self.device_generator = None
        self._device_rng = None  # a checkpoint's device generator state, set when draw_on makes it
        self._q = {}  # the proposal's q on each (device, dtype) the targets came on: made once
        #: the draw's mode, settled once: shared by the batch (one block) or per row (slots)
        self.mode = SharedDraw(self) if settings.shared else PerRowDraw(self)
        #: the slots' correction and hit mask (``draw_slots``), accidental hits masked or kept
        self.slots = self._slots_masking_hits if settings.remove_accidental_hits else self._slots_keeping_hits

    def draw_on(self, device: torch.device) -> None:
        """Draw on ``device`` from now on, reading nothing on the host (a CUDA graph captures
        the step, ``step="cuda_graph"``): the proposal's tables move there and a generator of that
        device draws (seeded once from the host generator, or given a checkpoint's state)."""
        device = torch.device(device)
        if self.device_generator is not None and self.device_generator.device == device:
            return
        self.sampler.to(device)
        generator = torch.Generator(device=device)
        if self._device_rng is not None:
            generator.set_state(self._device_rng)
        else:
            generator.manual_seed(int(torch.randint(2 ** 62, (), generator=self.generator)))
        self.device_generator = generator

    # -- copies: a pickled head, a spawned process, copy.deepcopy -----------------------------
    def __getstate__(self) -> dict:
        """The generators as their states' bytes. Pickled whole, a ``torch.Generator`` gives its state
        as a tensor made for the pickling, which ``torch.multiprocessing`` shares by a file
        descriptor that is closed, the tensor freed, before a spawned process reads it (that process
        fails with "unable to resize file"): so the head could not go to ``ddp_spawn``'s workers."""
        out = dict(self.__dict__)
        out["generator"] = _state_bytes(self.generator)
        if self.device_generator is not None:
            out["device_generator"] = (self.device_generator.device, _state_bytes(self.device_generator))
        return out

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state["generator"] = _generator_of(torch.device("cpu"), state["generator"])
        if state["device_generator"] is not None:
            state["device_generator"] = _generator_of(*state["device_generator"])
        self.__dict__.update(state)

    # -- resume: the generators' states in the head's extra state ---------------------------
    def state(self) -> dict:
        out = {"settings": self.settings.public(), "rng": self.generator.get_state()}
        if self.device_generator is not None:
            out["device_rng"] = self.device_generator.get_state()
        elif self._device_rng is not None:
            out["device_rng"] = self._device_rng
        return out

    def check_state(self, state: dict) -> None:
        if state["settings"].get("sampler") == "quadratic":
            raise ValueError(f"the state was saved with negatives.sampler='quadratic': {QUADRATIC_REFUSAL}")
        if Negatives.saved(state["settings"]) != self.settings.public():
            raise ValueError(f"the state was saved with negatives {state['settings']} but this head has "
                             f"{self.settings.public()}")
        try:
            torch.Generator().set_state(state["rng"])  # a scratch generator: a bad state is refused here
        except (RuntimeError, TypeError, KeyError) as e:
            raise ValueError(f"the state's negatives generator state cannot be loaded ({e})") from None
        if self.device_generator is not None and state.get("device_rng") is None:
            raise ValueError("the state was saved with negatives drawn on the host but this head draws them on "
                             "its device (step='cuda_graph'): resume it with the step it was saved with")

    def load_state(self, state: dict) -> None:
        self.check_state(state)
        self.generator.set_state(state["rng"])
        self._device_rng = state.get("device_rng")
        if self.device_generator is not None:  # else set when draw_on makes the device generator
            self.device_generator.set_state(self._device_rng)

    # -- the draw ---------------------------------------------------------------------------
    def uniforms(self, head, m: int) -> Tensor:
        """The randomness of the next draw for m rows, from the head's generator (the device's
        after ``draw_on``), and the proposal's q made once on the head's device: the host's
        part of a draw, outside a compiled step."""
        key = (head._factory["device"], head._factory["dtype"])
        if key not in self._q:
            self._q[key] = self.sampler.log_q.to(*key).exp()
        S = self.settings.num
        return self.sampler.uniforms(S if self.settings.shared else m * S,
                                     generator=self.device_generator or self.generator)

    def draw(self, head, idx: Tensor, u: Tensor | None = None):
        """``draw_slots`` for ``head``: by the uniforms ``u`` (None: drawn here, ``uniforms``)."""
        u = self.uniforms(head, idx.shape[0]) if u is None else u
        return self.draw_slots(idx, u, head.dtype)

    def draw_slots(self, idx: Tensor, u: Tensor, dtype: torch.dtype):
        """S negatives (shared: (S,); per row: (m, S)), drawn by the uniforms ``u`` (``uniforms``),
        as the draw's mode draws them (``mode.draw``): (the columns, their distinct classes and each
        column's place among them (shared; per row: None), the slots' correction and hit mask)."""
        return self.mode.draw(idx, u, dtype)

    def _slots_masking_hits(self, idx: Tensor, cols: Tensor, log_q: Tensor, dtype: torch.dtype) -> SampledSlots:
        """The slots of the negatives ``cols`` (shared: (S,), one row for all; per row: (m, S)) of
        log-probability ``log_q``: their correction ``log(k q / (1 - q_T))``, a negative equal to one
        of its row's targets masked out (an accidental hit), q_T the row's targets' q."""
        m, S = idx.shape[0], self.settings.num
        neg_m, log_q = cols.expand(m, S), log_q.reshape(-1, S).expand(m, S)
        first = first_occurrence(idx)
        hit = neg_m == idx if idx.shape[1] == 1 else (neg_m[:, :, None] == idx[:, None, :]).any(2)
        kept = (~hit).sum(1, keepdim=True).clamp(min=1).to(dtype)
        q_idx = self._q[(idx.device, dtype)][idx.clamp(min=0)]
        q_t = torch.where(first, q_idx, torch.zeros((), dtype=dtype, device=idx.device)).sum(1, keepdim=True)
        log_rest = torch.log1p(-q_t.clamp(max=1 - 1e-6))
        return SampledSlots(log_q + kept.log() - log_rest, hit, first)

    def _slots_keeping_hits(self, idx: Tensor, cols: Tensor, log_q: Tensor, dtype: torch.dtype) -> SampledSlots:
        """``_slots_masking_hits`` with ``remove_accidental_hits=False``: every negative kept, the
        correction ``log(S q)``."""
        m, S = idx.shape[0], self.settings.num
        log_q = log_q.reshape(-1, S).expand(m, S)
        first = first_occurrence(idx)
        hit = torch.zeros((m, S), dtype=torch.bool, device=idx.device)
        kept = torch.full((m, 1), float(S), dtype=dtype, device=idx.device)
        log_rest = torch.zeros((m, 1), dtype=dtype, device=idx.device)
        return SampledSlots(log_q + kept.log() - log_rest, hit, first)


class SharedDraw:
    """The draw's mode of negatives shared by the batch (``NegativeSampling.mode``, the plan's
    ``slots``): one draw of S, coalesced in shapes fixed by S (``padded_unique``: no host read),
    the step's part a ``SharedBlock`` (one dense block)."""

    def __init__(self, sampling: NegativeSampling):
        self.sampling = sampling

    def draw(self, idx: Tensor, u: Tensor, dtype: torch.dtype):
        """``NegativeSampling.draw_slots``: (cols (S,), uniq, inv, slots)."""
        ns = self.sampling
        neg, log_q = ns.sampler.at(u)
        uniq, inv = padded_unique(neg.to(idx.device, non_blocking=True))
        neg, log_q = neg.to(idx.device, non_blocking=True), log_q.to(idx.device, dtype, non_blocking=True)
        return neg, uniq, inv, ns.slots(idx, neg, log_q, dtype)

    def loss_and_grads(self, plan, state, q: Tensor, s: Tensor, A: Tensor, idx: Tensor, T: Tensor, HUt: Tensor,
                       ht: Tensor, u: Tensor, weight: Tensor, y_sq: Tensor | None):
        """The draw (by the uniforms ``u``), the negatives' outputs and the composite loss's
        per-row values and gradients (in closed form), the rows weighted by ``weight``: (per, g_q,
        g_s, G_A, idx, the block); the negatives stay apart, in the ``SharedBlock``, V's rows of
        its classes fetched once (several processes: every rank drew the same negatives from the
        same seed)."""
        cols, uniq, inv, slots = self.draw(idx, u, q.dtype)
        V_u = plan.rows_of(state.V, uniq)
        A_neg = torch.addmm(ht[:, None], HUt, V_u.index_select(0, inv).T)  # (H U^T) V[neg]^T + H omega: one GEMM
        per, gq, gs, GA, G_neg = plan.loss.with_slots_grads(q, s, A, T, A_neg, slots, weight,
                                                            num_classes=plan.num_classes, y_sq=y_sq)
        return per, gq, gs, GA, idx, SharedBlock(cols, uniq, inv, G_neg, V_u)

    def records_block(self, plan, state, cols: Tensor, G_neg: Tensor) -> "SharedBlock":
        """Exact accumulation's shared negatives: the micro-batches' draws side by side (``cols``,
        k S) with their gradients block-diagonal (``G_neg``, M x k S: a row's own draw only), as one
        block of the union's step, V's rows fetched now (W has not moved since the records' forwards)."""
        uniq, inv = padded_unique(cols)
        return SharedBlock(cols, uniq, inv, G_neg, plan.rows_of(state.V, uniq))


class PerRowDraw:
    """The draw's mode of negatives drawn per row (``NegativeSampling.mode``, the plan's ``slots``):
    S a row, extra slots of the general path (``PerRowSlots``)."""

    def __init__(self, sampling: NegativeSampling):
        self.sampling = sampling

    def draw(self, idx: Tensor, u: Tensor, dtype: torch.dtype):
        """``NegativeSampling.draw_slots``: (cols (m, S), None, None, slots)."""
        ns = self.sampling
        m, S = idx.shape[0], ns.settings.num
        neg, log_q = ns.sampler.at(u)
        neg, log_q = neg.to(idx.device, non_blocking=True), log_q.to(idx.device, dtype, non_blocking=True)
        cols = neg.reshape(m, S)
        return cols, None, None, ns.slots(idx, cols, log_q, dtype)

    def loss_and_grads(self, plan, state, q: Tensor, s: Tensor, A: Tensor, idx: Tensor, T: Tensor, HUt: Tensor,
                       ht: Tensor, u: Tensor, weight: Tensor, y_sq: Tensor | None):
        """``SharedDraw.loss_and_grads`` of negatives drawn per row: idx and G_A carry them as extra
        slots (the general path)."""
        cols, _, _, slots = self.draw(idx, u, q.dtype)
        A_neg = plan.gather_dot(state.V, cols, HUt, ht)
        per, gq, gs, GA, G_neg = plan.loss.with_slots_grads(q, s, A, T, A_neg, slots, weight,
                                                            num_classes=plan.num_classes, y_sq=y_sq)
        return per, gq, gs, torch.cat([GA, G_neg], 1), torch.cat([idx, cols], 1), PerRowSlots()

    def slots_part(self) -> "PerRowSlots":
        """Exact accumulation's records of negatives drawn per row carry each as a slot: their Yd Yd^T
        by unique columns."""
        return PerRowSlots()


def padded_unique(ids: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` in shapes fixed by ids (n,), for
    a step that reads nothing on the host (a CUDA graph): ``uniq`` (n,) holds the u distinct ids
    in increasing order, then n - u copies of the largest (still sorted, so ``searchsorted``
    finds each id's first place); ``inv`` (n,) each id's place among the first u. The block's
    columns past u get no draw, so a gradient of zero: they add exact zeros to every product
    and to V's rows (SharedBlock)."""
    s, order = torch.sort(ids)
    new = torch.ones_like(s, dtype=torch.bool)
    new[1:] = s[1:] != s[:-1]
    seg = torch.cumsum(new, 0) - 1  # each sorted id's place among the distinct ones
    inv = torch.empty_like(seg).scatter_(0, order, seg)
    uniq = s[-1:].expand(s.shape[0]).clone().scatter_(0, seg, s)
    return uniq, inv


def add_rows_(V: Tensor, dim: int, ids: Tensor, rows: Tensor) -> None:
    """V[ids] += rows (along ``dim`` 0), ``Tensor.index_add_``: on the CPU summed in the order of ids.
    A function, not the method itself, in the plan: Dynamo of torch 2.11 traces no method
    descriptor held by a dataclass."""
    V.index_add_(dim, ids, rows)


def add_own_rows_(processes, V: Tensor, dim: int, ids: Tensor, rows: Tensor) -> None:
    """V[ids] += rows (along ``dim`` 0) into the rows of V this rank holds (sharded): the others add
    zeros to row 0."""
    if V.shape[0]:
        local = processes.local_idx(ids)
        V.index_add_(dim, local.clamp(min=0), torch.where(local[:, None] >= 0, rows, 0.0))


def add_in_order_(kernels, out: Tensor, dim: int, ids: Tensor, rows: Tensor) -> None:
    """out[ids] += rows (along ``dim`` 0), summed in the order of ids by the deterministic scatter
    (``lk.scatter_add_rows_``: no float atomics on a GPU)."""
    kernels.scatter_add_rows_(out, ids[:, None], rows.new_ones(rows.shape[0], 1), rows, 1.0)


class PerRowSlots(TargetsOnly):
    """Negatives drawn per row: the last S of the step's K + S slots (the general path, value 0);
    the rest as for the targets alone."""

    def gram(self, plan, idx: Tensor, GA: Tensor) -> Tensor:
        """Yd Yd^T (m x m), never the slot-pair form (``lk.sparse_gram`` compares (m (K + S))^2
        pairs: 13.5 GB at m = 128, S = 512): Yd (Yd^T I) by rows (``lk.gram_rows``, static shapes,
        no host read): O(m (K + S) m) memory, within O(m (K + S) d) on this route (the step takes it
        for m <= d)."""
        return plan.kernels.gram_rows(idx, GA, torch.eye(idx.shape[0], dtype=GA.dtype, device=GA.device))


@dataclass(eq=False)
class SharedBlock:
    """Negatives shared by the batch: S columns of Yd as one dense block, never changed once made.

    ``cols`` (S,) the draw, ``uniq`` (S,) its distinct classes (``padded_unique``'s: the columns
    past the distinct ones unused), ``inv`` (S,) each draw's place among them, ``G_neg`` (m, S)
    dL/dA_neg, ``V_u`` (S, d) their rows of V at the forward (the step's V: it changes only at the
    write); ``G_u`` (m, S) the step's gradients on the unique columns (repeated negatives summed):
    None in the forward's block, held by the block ``hidden`` returns. The sums over repeated columns
    are the deterministic scatter's (``lk.scatter_add_rows_``: in a fixed order, no float atomics
    on a GPU: the eager step and its CUDA graph give the same bits)."""

    shared = True

    cols: Tensor
    uniq: Tensor
    inv: Tensor
    G_neg: Tensor
    V_u: Tensor
    G_u: Tensor | None = None

    def hidden(self, plan, grad: Tensor | None, YV: Tensor, ybar: Tensor) -> tuple[Tensor, Tensor, "SharedBlock"]:
        """The block's part of Yd V (one GEMM) and of Yd's row sums, added to ``YV`` and ``ybar``, and
        the block with G_u (a new one): the step's gradients coalesced to the unique columns
        (repeated negatives summed: G_u^T[inv[j]] += G_neg^T[j], O(m S)) in the order of j on every
        device (the plan's ``index_add_in_order``). ``grad``: the upstream gradient (None: 1)."""
        G = self.G_neg if grad is None else self.G_neg * grad
        G_ut = G.new_zeros(self.uniq.numel(), G.shape[0])
        # rows copied whole: 0.16 against 0.29 ms from G.T's strided columns on the CPU (m = 128, S = 512)
        plan.index_add_in_order(G_ut, 0, self.inv, G.T.contiguous())
        G_u = G_ut.T
        return torch.addmm(YV, G_u, self.V_u.to(YV.dtype)), ybar + G.sum(1), dataclasses.replace(self, G_u=G_u)

    def gram(self, plan, idx: Tensor, GA: Tensor) -> Tensor:
        """Yd Yd^T. The targets that fall on a negative's column (accidental hits, across rows
        too) join the block there: with Y_u = G_u + those targets' gradients (m x u), the
        column sets are disjoint, so Yd Yd^T = sparse_gram(the other targets) + Y_u Y_u^T."""
        hit, GA_on = self._hits(idx, GA)
        if idx.shape[1] > 1:  # a row's targets on one column (a class repeated in the row)
            cols = torch.arange(self.uniq.numel(), device=hit.device)  # summed in order
            Y_u = self.G_u + (GA_on[:, :, None] * (hit[:, :, None] == cols)).sum(1)
        else:  # one target a row: at most one add to each entry
            Y_u = self.G_u.scatter_add(1, hit.clamp(min=0), GA_on)
        return torch.addmm(plan.kernels.sparse_gram(idx, GA - GA_on), Y_u, Y_u.T)

    def gram_terms(self, plan, idx: Tensor, GA: Tensor, H: Tensor, order: lk.SortedIds | None = None):
        """H^T Yd Yd^T H in two terms, split as ``gram``: (Yd Yd^T H of the other targets, by rows:
        ``lk.gram_rows``; the block's H^T Y_u Y_u^T H = N_Y^T N_Y, d x d), and N = G_u^T H (one
        GEMM, for the write's ``scatter_``). N_Y = Y_u^T H is N plus the hits' rows,
        N_Y[hit] += GA h (the deterministic scatter, O(m K d))."""
        hit, GA_on = self._hits(idx, GA)
        N = self.G_u.T @ H.to(self.G_u.dtype)
        N_Y = plan.kernels.scatter_add_rows_(N.clone(), hit, GA_on, H.to(N.dtype), 1.0)
        return plan.kernels.gram_rows(idx, GA - GA_on, H, order), N_Y.T @ N_Y, N

    def _hits(self, idx: Tensor, GA: Tensor) -> tuple[Tensor, Tensor]:
        """The targets on the block's columns: each slot's column among the block's (-1 off
        them) and their gradients (0 off them)."""
        uniq = self.uniq
        pos = torch.searchsorted(uniq, idx.clamp(min=0)).clamp(max=uniq.numel() - 1)
        on_neg = (idx >= 0) & (uniq[pos] == idx)
        return (torch.where(on_neg, pos, -1),
                torch.where(on_neg, GA, torch.zeros((), dtype=GA.dtype, device=GA.device)))

    def scatter_(self, plan, V: Tensor, HUinv: Tensor, alpha, ok, right: Tensor | None = None,
                 N: Tensor | None = None) -> None:
        """V[u] += alpha G_u^T (H U_new^-1), masked by the device flag ``ok``, one index_add_
        (the plan's ``index_add_rows``: sharded, into the rows this rank holds). As alpha N R
        where H U_new^-1 = H R (``right``, the products and the solve: R = P U_new^-1) and N = G_u^T H
        was made (``gram_terms``): u d^2 multiply-adds instead of m u d."""
        rows = self.G_u.T @ HUinv if right is None or N is None else N @ right.to(N.dtype)
        plan.index_add_rows(V, 0, self.uniq, torch.where(ok, alpha * rows, 0.0).to(V.dtype))
