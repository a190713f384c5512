"""The interface every output head implements, so that one LightningModule can
train and evaluate any of them.

A head maps the body's last hidden layer ``H`` (m, d) and targets to a scalar
training loss, and gives full-vocabulary scores (in chunks of classes) for
top-k error rates and ranks. Two kinds exist:

- self-updating heads (``self_updating = True``: the factored and naive
  spherical heads) apply their own exact SGD step inside ``loss.backward()``
  and hold no ``nn.Parameter``; the training loop sets ``head.lr`` each step;
- ordinary heads (softmax, hierarchical, adaptive, sampled) hold parameters
  that the optimizer trains.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from .flag_board import FlagBoard
from .ranking import count_at_or_above, target_scores_of_chunks, topk_of_chunks
from .targets import check_class_ids, check_hidden, check_k


def keys_problem(expected: set[str], given: set[str], optional: tuple[str, ...] = ()) -> str | None:
    """What a strict load of a state with the keys ``given`` into a module expecting ``expected``
    would find missing or not the module's (``optional``: keys a state may hold or not), or None."""
    missing, unexpected = sorted(expected - given), sorted(given - expected - set(optional))
    if not (missing or unexpected):
        return None
    return (f"the state is not this head's: missing {missing or 'nothing'}, not this head's {unexpected or 'nothing'} "
            "(strict=False loads the keys both have)")


class OutputHead(nn.Module):
    """Base class of all output heads. The class attributes and the methods with a
    default body are the capabilities a training loop may ask a head about; the
    defaults describe an ordinary one-process head trained by an optimizer."""

    #: True when the head updates itself in backward (no optimizer parameters).
    self_updating: bool = False
    #: True when ``log_prob`` gives normalised log-probabilities (perplexity).
    has_log_prob: bool = False
    #: How a training step may run: "autograd" (the loss's backward), and for the
    #: factored head "fused" (forward, backward and update in one call) and
    #: "cuda_graph" (that call replayed from a CUDA graph). ``step`` is the current one.
    step_modes: tuple[str, ...] = ("autograd",)
    step: str = "autograd"
    #: The multi-process modes the head runs itself ("replicated", "sharded"); a
    #: self-updating head needs one under DDP, which cannot average its update.
    parallel_modes: tuple[str, ...] = ()
    parallel: str = "none"
    #: True when rank r holds only the rows ``V[row_lo:row_hi]`` of its slice of the
    #: classes; such a head also has ``gather_v()`` (all rows, for a checkpoint).
    sharded: bool = False
    #: True when the training step leaves its checks on the device (read every few
    #: steps): the loop must not read the loss on the host each step either.
    deferred_checks: bool = False
    #: The board of device flags the head reads its own with (flag_board.py): a loop's device
    #: flags registered on it ride on the head's read, every few steps with ``deferred_checks``.
    #: None: the head has none.
    flag_board: FlagBoard | None = None
    #: True when the head's own training step runs compiled (the factored head on a GPU:
    #: ``compile_step``); a loop that compiles its model leaves such a head out of its graph.
    compiles: bool = False
    #: "mean" or "sum" over the rows of a batch.
    reduction: str = "mean"

    num_classes: int
    hidden_dim: int

    def distribute(self, process_group=None) -> None:
        """Join the ranks of ``process_group`` (every rank calls it once torch.distributed
        is up). Nothing to do for a head that keeps no state of its own across ranks."""

    def buffers_kept_alike(self) -> list[str]:
        """The names of the buffers the head keeps consistent across ranks itself (its replicas, its
        shards, or state it forms from every rank's rows), which DDP must not overwrite with rank
        0's: all of them for a head that updates itself or runs a multi-process mode of its own,
        none by default (DDP copies an ordinary head's buffers from rank 0)."""
        if self.self_updating or self.parallel != "none":
            return [n for n, _ in self.named_buffers()]
        return []

    def cannot_accumulate(self) -> str | None:
        """Why this head cannot take one exact step for several micro-batches at the optimizer's
        step (gradient accumulation, a loss scaler), or None when it can. An ordinary head can:
        the optimizer accumulates its gradients."""
        return "it updates itself in backward" if self.self_updating else None

    def cannot_compile(self) -> str | None:
        """Why ``torch.compile`` cannot take this head's training forward whole (one graph, static
        shapes, no host read), or None when it can. Under compilation a head leaves its host
        checks to the loop (``heads.targets``: the loop reads the loss every few steps). A
        self-updating head steps itself in backward: a loop leaves it out of its graph (the
        factored head compiles its own step: ``compiles``)."""
        return "it steps itself in backward (the factored head compiles its own step)" if self.self_updating else None

    def compiles_on(self, device: torch.device) -> bool:
        """Whether the head's own training step runs compiled once it is on ``device`` (a loop
        asks before it moves the head there); ``compiles`` unless the head says otherwise."""
        return self.compiles

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's ``load_state_dict``, the state checked whole first (``state_problem``): a state that
        cannot load whole is refused in one line and nothing is loaded, where torch's own copies the
        tensors that fit, then raises in several lines."""
        problem = self.state_problem(state_dict, strict)
        if problem is not None:
            raise RuntimeError(f"{type(self).__name__}: {problem}; nothing was loaded")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def state_problem(self, state_dict, strict: bool = True) -> str | None:
        """Why ``state_dict`` cannot load whole into this head (a tensor of another shape; with
        ``strict`` a key missing, or one that is not this head's), or None. The spherical heads
        check their state themselves as they load it, before any buffer changes."""
        mine = self.state_dict(keep_vars=True)
        for key, t in mine.items():
            v = state_dict.get(key)
            if isinstance(t, Tensor) and isinstance(v, Tensor) and v.shape != t.shape:
                return (f"the state's {key} has shape {tuple(v.shape)} but this head's is {tuple(t.shape)}: it was saved by "
                        "a head of another size")
        return keys_problem(set(mine), set(state_dict)) if strict else None

    def stats(self) -> dict[str, float]:
        """Counters worth logging (repairs, skipped steps...): none by default."""
        return {}

    def logged_stats(self) -> dict[str, float]:
        """``stats()`` as a training loop logs them every few steps: ``stats()`` by default; a head
        that reads its counters itself every few steps gives the values of its last read, with no
        device read of its own (the factored head under device flags)."""
        return self.stats()

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are row-sparse (torch sparse COO tensors holding
        only the rows a step read): a training loop steps them with a row-sparse optimiser
        (``torch.optim.SparseAdam``), as it does a sparse ``nn.Embedding``. None by default."""
        return []

    def forward(self, hidden: Tensor, target_idx: Tensor, target_val: Tensor | None = None) -> Tensor:
        """The training loss (a scalar)."""
        raise NotImplementedError

    def scores(self, hidden: Tensor, start: int = 0, end: int | None = None) -> Tensor:
        """Scores of classes ``start:end`` for each row of ``hidden``: (m, end - start).

        Higher is more likely; used for top-k error rates and ranks.
        """
        raise NotImplementedError

    def score_chunks(self, hidden: Tensor, chunk_size: int = 65536) -> Iterator[tuple[int, Tensor]]:
        """Full-vocabulary scores in chunks of classes: yields (start, scores)."""
        for start in range(0, self.num_classes, chunk_size):
            end = min(start + chunk_size, self.num_classes)
            yield start, self.scores(hidden, start, end)

    def log_prob(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """log p(target | hidden), shape (m,), for heads that define probabilities."""
        raise NotImplementedError(f"{type(self).__name__} defines no normalised probabilities")

    @torch.no_grad()
    def target_score(self, hidden: Tensor, target_idx: Tensor) -> Tensor:
        """The score of each row's target class, (m,). Heads may override this with a gather."""
        target_idx = check_class_ids(target_idx, hidden.shape[0], self.num_classes, "target_score")
        return target_scores_of_chunks(self.score_chunks(hidden), target_idx)

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """The k best classes of each row, best first: (scores, class ids), (m, min(k, D)) each."""
        return topk_of_chunks(self.score_chunks(hidden, chunk_size), check_k(k))

    @torch.no_grad()
    def target_rank(self, hidden: Tensor, target_idx: Tensor, chunk_size: int = 65536) -> Tensor:
        """1-based rank of each row's target among all classes, (m,).

        Ties count against the target (a constant scorer ranks it last, not first). The
        target's score is read from the same chunks of scores as every other class (not
        ``target_score``'s gather, whose rounding differs): a class scoring exactly as the
        target counts against it. Scores are made in chunks of classes: (m, D) is never held
        at once. Every target must be a class id (ValueError for padding or out-of-range ids).
        """
        check_hidden(hidden, self.hidden_dim, finite=False)
        target_idx = check_class_ids(target_idx, hidden.shape[0], self.num_classes)
        target = target_scores_of_chunks(self.score_chunks(hidden, chunk_size), target_idx)
        return 1 + count_at_or_above(self.score_chunks(hidden, chunk_size), target_idx, target)
