"""Sampled softmax: the softmax over the targets and S sampled negatives, with
the logit correction -log(S q) (Bengio & Senecal; Jean et al.) and accidental
hits removed. In eval mode the loss is the exact full softmax, and scores
cover all classes.

Accidental hits (negatives equal to a target of their row) are dropped, so the
k kept negatives of a row are i.i.d. draws from q restricted to the
non-target classes, q / (1 - q_T); the correction uses that law and k:
``o_s - log(k q_s / (1 - q_T))``. Then sum_s exp(o'_s) estimates the
non-target mass without bias, and with q = the model's softmax the
normaliser is exact and the gradient unbiased (Rawat et al. 2019, eq. 5).
"""
from __future__ import annotations

import torch
from torch import Tensor

import lst_kernels as lk

from .samplers import make_sampler
from .linear import LinearClassHead
from .preconditioned_rows import preconditioned_logits, row_logits
from .row_sparse import row_gather
from ..rows import row_grad_of
from ..distributed.collectives import ProcessGroup
from ..heads.preconditioner import Moments, Preconditioner
from ..heads.samplers import sampled_softmax_num_samples
from ..heads.state_dtype import STATE_DTYPES, kept_in_dtype
from ..heads.targets import check_targets, first_occurrence, in_head_dtype, reduce_rows

#: the preconditioner's running moments, buffers of the head
MOMENTS = ("input_moment", "input_moment_weight")


class SampledSoftmaxHead(LinearClassHead):
    """Sampled softmax with a ``sampler=`` choice (see ``lst_lightning.samplers.SAMPLERS``).

    Kernel samplers (``rff``, ``quadratic``) keep a sum-tree of the class
    embeddings: after each optimizer step the rows trained since the last sync
    (targets and negatives: the only rows plain SGD changes) are updated in
    the tree, and the whole tree is rebuilt every ``resync_every``
    steps to catch rows moved by momentum or weight decay. A stale tree only
    makes q a worse match of the softmax: ``log q`` is always that of the
    law actually drawn from, so the correction stays right.

    ``num_samples``: S, the negatives a step draws (None: 64 below 10^5 classes, 512 from
    there, 1024 from 10^6, its best at equal time, ``heads.samplers.sampled_softmax_num_samples``).

    ``sparse``: the training step's gradient of W and b holds only the rows it read
    (targets and negatives; ``sparse_parameters()``), for a row-sparse optimiser
    (``torch.optim.SparseAdam``): the step then costs O(m S d) whatever D. False: dense
    gradients (D x d), for any optimiser. Evaluation is the same either way.

    ``preconditioner`` (a ``Preconditioner``, a dict of its settings, or None: off): the drawn rows'
    gradient taken against X P rather than X = [h, 1] (preconditioned_rows.py), P the exact
    head's right preconditioner from the running moments of X (two buffers, ``input_moment`` and
    ``input_moment_weight``, written by each training forward that autograd records, over the rows
    with a target). With SGD on the rows (``optimizer.head_rows=row_sgd``; ``head=sampled_preconditioned``)
    a step is the exact head's update with the all-class term left out. The logits, the loss and
    dL/dh are unchanged; a batch whose loss is not finite leaves the moments as they were. On several
    processes (``distribute()``: every rank, lst-train's setup; else the first eager training forward
    joins the default group) every rank's moments are those of the global batch: the ranks' X^T X and
    row counts are summed (one all-reduce) before the new moment, and none writes it where one rank's
    loss is not finite or P's factorisation failed (a second all-reduce, of that flag), so the ranks
    hold the same moments and P, one process's on the union of their batches. The moments follow
    ``.float()`` and ``.double()``; a cast to half precision keeps them in their dtype, as the exact
    head keeps its state.
    """

    def __init__(self, num_classes: int, hidden_dim: int, *, num_samples: int | None = None,
                 sampler: str = "log_uniform", sampler_kwargs: dict | None = None,
                 class_counts: Tensor | None = None, remove_accidental_hits: bool = True,
                 resync_every: int = 100, bias: bool = False, init_std: float | None = None,
                 cosine_scale: float | None = None, reduction: str = "mean", sparse: bool = False,
                 preconditioner: Preconditioner | dict | None = None, dtype: torch.dtype | None = None,
                 device=None):
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be true or false, got {sparse!r}")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                        or num_samples < 1):
            raise ValueError(f"num_samples must be a positive int or None (S for D), got {num_samples!r}")
        if not isinstance(resync_every, int) or resync_every < 1:
            raise ValueError(f"resync_every must be a positive int, got {resync_every!r}")
        preconditioner = Preconditioner.of(preconditioner)
        if preconditioner is not None and cosine_scale is not None:
            raise ValueError("preconditioner takes the rows' gradient against [h, 1] P: it cannot be combined with "
                             "cosine_scale (normalised rows and hidden states)")
        sampler_module = make_sampler(sampler, num_classes=num_classes, hidden_dim=hidden_dim,
                                      class_counts=class_counts, **dict(sampler_kwargs or {}))
        super().__init__(num_classes=num_classes, hidden_dim=hidden_dim, bias=bias, init_std=init_std,
                         cosine_scale=cosine_scale, reduction=reduction, dtype=dtype, device=device)
        self.sampler = sampler_module.to(device) if device is not None else sampler_module
        self.sampler_name = sampler
        self.sparse = sparse
        #: S (None: S for D, ``heads.samplers.sampled_softmax_num_samples``)
        self.num_samples = sampled_softmax_num_samples(self.num_classes) if num_samples is None else num_samples
        self.remove_accidental_hits = bool(remove_accidental_hits)
        self.resync_every = resync_every
        self._synced_version: int | None = None
        self._steps_since_build = 0
        self._touched: Tensor | None = None
        #: the right preconditioner of the drawn rows' gradient (None: off), its moments in the
        #: head's floating type (float32 at least)
        self.preconditioner = preconditioner
        if preconditioner is not None:
            width = hidden_dim + (self.bias is not None)
            kind = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
            self.register_buffer("input_moment", torch.zeros(width, width, dtype=kind, device=device))
            self.register_buffer("input_moment_weight", torch.zeros((), dtype=kind, device=device))
        #: the ranks whose rows make the moments (``distribute``); one process until it runs
        self.pg = ProcessGroup()
        self._joined = False

    def distribute(self, process_group=None) -> None:
        """Join the ranks of ``process_group`` (default: the whole world; alone without torch.distributed):
        from here the moments are over every rank's rows. No collective runs here: the ranks' moments
        must start alike (zeros, or one checkpoint), and every rank's training forwards then keep them so."""
        self.pg, self._joined = ProcessGroup.current(process_group), True

    def buffers_kept_alike(self) -> list[str]:
        return super().buffers_kept_alike() + (list(MOMENTS) if self.preconditioner is not None else [])

    def _apply(self, fn, recurse=True):
        # The moments follow a move to float32 or float64; a cast to half precision (.half(),
        # .to(torch.bfloat16)) moves them to its device only, in their dtype.
        if self.preconditioner is not None:
            probe = fn(self.input_moment.new_zeros(()))
            if probe.dtype not in STATE_DTYPES:
                kept = {id(getattr(self, n)) for n in MOMENTS}
                fn = kept_in_dtype(fn, probe.device, lambda t: id(t) in kept)
        return super()._apply(fn, recurse)

    def sparse_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None] if self.sparse else []

    def _rows(self, table: Tensor, idx: Tensor) -> Tensor:
        return row_gather(table, idx, self.sparse and self.training)

    # -- keeping a kernel sampler in step with W -------------------------------
    @torch.no_grad()
    def sync_sampler(self, full: bool = False) -> None:
        """Hand the sampler the class embeddings that changed since it last saw them."""
        if not self.sampler.needs_embeddings:
            return
        version = self.weight._version
        if version == self._synced_version and not full:
            return
        partial = hasattr(self.sampler, "tree") and self._touched is not None and self._synced_version is not None
        if partial and not full and self._steps_since_build + 1 < self.resync_every:
            rows = self._touched
            self.sampler.sync(self._keys(self.weight[rows]), None, rows=rows)
            self._steps_since_build += 1
        else:
            self.sampler.sync(self._keys(self.weight), self.bias)
            self._steps_since_build = 0
        self._synced_version = version
        self._touched = None  # rows trained since this sync accumulate from here

    def _draw(self, query: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Negatives (m, S), their log q (m, S), and log q of the targets (m, K)."""
        m = query.shape[0]
        S = self.num_samples
        if self.sampler.conditional:
            neg, log_q = self.sampler.sample(S, query)
            log_q_t = self.sampler.log_prob(idx, query)
        else:
            neg, log_q = self.sampler.sample(S)
            neg, log_q = neg.expand(m, S), log_q.expand(m, S)
            log_q_t = self.sampler.log_prob(idx)
        return neg, log_q, log_q_t

    def _redraw_all_hit_rows(self, query, idx, neg, log_q, hit, tries: int = 8):
        """Redraw rows whose every negative hit a target (probability q_T^S): the kept
        draws are then those of the law given k >= 1, keeping the estimate unbiased.
        Rows are independent under a conditional sampler, so this is plain rejection."""
        neg, log_q, hit = neg.clone(), log_q.clone(), hit.clone()
        for _ in range(tries):
            rows = hit.all(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            n2, lq2 = self.sampler.sample(self.num_samples, query[rows])
            neg[rows], log_q[rows] = n2, lq2
            hit[rows] = (n2.unsqueeze(2) == idx[rows].unsqueeze(1)).any(2)
        return neg, log_q, hit

    def _summed_over_ranks(self, gram: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
        """X^T X and the row count summed over the ranks, in one all-reduce: the same bits on every rank."""
        both = self.pg.all_reduce_(torch.cat([gram.reshape(-1), n.to(gram.dtype)[None]]))
        return both[:-1].view_as(gram), both[-1]

    def _moments(self, query: Tensor, real: Tensor) -> tuple[Moments, Tensor]:
        """This step's moments of X = [query, 1] over the ``real`` rows, every rank's (aside: the
        buffers are written by ``forward``) and X P, with P = I where its factorisation failed."""
        X = query.to(self.input_moment.dtype)
        if self.bias is not None:
            X = torch.cat([X, torch.ones_like(X[:, :1])], 1)
        summed = self._summed_over_ranks if self.pg.world > 1 else None
        new = self.preconditioner.update_moments(self.input_moment, self.input_moment_weight, X, real, summed)
        eye = torch.eye(X.shape[1], dtype=X.dtype, device=X.device)
        return new, X @ torch.where(new.ok, new.P, eye)

    def _sampled_logits(self, query: Tensor, idx: Tensor, neg: Tensor,
                        XP: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The targets' logits (m, K) and the sampled classes' (m, S), from one gather of W (and
        of b): the m K targets' rows, then the S shared classes' (or the m S drawn per row), so
        that a row-sparse table is read once a step (static rows: one RowGrad a table). ``XP``:
        the rows' gradient taken against it (preconditioned_rows.py)."""
        m, K = idx.shape
        shared = not self.sampler.conditional  # one (m, S) matmul against S rows
        drawn = neg[0] if shared else neg.reshape(-1)
        ids = torch.cat([idx.reshape(-1), drawn])
        w = self._keys(self._rows(self.weight, ids))
        b = None if self.bias is None else self._rows(self.bias, ids)
        w_t, b_t = w[:m * K].view(m, K, -1), None if b is None else b[:m * K].view(m, K)
        w_n, b_n = w[m * K:], None if b is None else b[m * K:]
        if not shared:
            w_n, b_n = w_n.view(m, -1, w.shape[-1]), None if b_n is None else b_n.view(m, -1)
        if XP is not None:
            return preconditioned_logits(query, w_t, b_t, XP), preconditioned_logits(query, w_n, b_n, XP)
        return row_logits(query, w_t, b_t), row_logits(query, w_n, b_n)

    def cannot_compile(self) -> str | None:
        if self.sampler.needs_embeddings:
            return f"sampler={self.sampler_name!r} keeps a sum-tree of the class rows on the host"
        if self.sampler.conditional:
            return f"sampler={self.sampler_name!r} redraws, on the host, the rows whose every sample hit a target"
        if self.sparse and row_grad_of(self.weight) is None:
            return ("its row-sparse rows' gradient is a torch sparse tensor, whose size changes each step "
                    "(static rows: optimizer.head_rows=row_adam or row_sgd)")
        return None

    @in_head_dtype
    def forward(self, hidden: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        idx, val, valid = check_targets(hidden, target_idx, target_val, self.num_classes, self.hidden_dim)
        if not self.training:
            # Evaluation: the exact full-softmax loss, comparable across heads.
            log_z = self.log_normaliser(hidden)[:, None]
            return reduce_rows((val * (log_z - self.class_logits(hidden, idx).float())).sum(1), self.reduction)
        query = self._query(hidden)
        moments = XP = None
        stepped = self.preconditioner is not None and torch.is_grad_enabled()  # a step will follow
        if stepped and not self._joined and not torch.compiler.is_compiling():
            self.distribute()
        with torch.no_grad():
            if stepped:
                moments, XP = self._moments(query.detach(), valid.any(1))
            self.sync_sampler()
            neg, log_q, log_q_t = self._draw(query.detach(), idx)
            first = first_occurrence(idx)
            if self.remove_accidental_hits:
                hit = (neg.unsqueeze(2) == idx.unsqueeze(1)).any(2)
                if self.sampler.conditional:
                    neg, log_q, hit = self._redraw_all_hit_rows(query.detach(), idx, neg, log_q, hit)
                kept = (~hit).sum(1, keepdim=True).clamp(min=1)
                q_t = torch.where(first, log_q_t.exp(), torch.zeros_like(log_q_t)).sum(1, keepdim=True)
                log_rest = torch.log1p(-q_t.clamp(max=1 - 1e-6))
            else:
                hit = torch.zeros_like(neg, dtype=torch.bool)
                kept, log_rest = torch.full_like(neg[:, :1], self.num_samples), torch.zeros_like(log_q[:, :1])
            correction = log_q + kept.log() - log_rest
            if self.sampler.needs_embeddings:  # rows this step trains, kept (over accumulated
                # forwards) until the next sync; a static sampler never syncs, so never keeps them
                new_rows = [idx[valid], neg.reshape(-1)] + ([] if self._touched is None else [self._touched])
                self._touched = torch.unique(torch.cat(new_rows))
        o_t, o_n = self._sampled_logits(query, idx, neg, XP)
        o_n = (o_n.float() - correction).masked_fill(hit, float("-inf"))
        o_z = o_t.float().masked_fill(~first, float("-inf"))  # each target class once in Z
        log_z = lk.logsumexp_rows(torch.cat([o_z, o_n], 1))
        per_row = (val * (log_z - o_t.float())).sum(1)
        if moments is not None:
            ok = moments.ok & torch.isfinite(per_row.detach()).all()
            if self.pg.world > 1:  # written on every rank or on none
                ok = self.pg.all_reduce_((~ok).to(torch.int32)) == 0
            moments.write(self, ok)
        return reduce_rows(per_row, self.reduction)
