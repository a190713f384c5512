"""Evaluation of a sharded factored head: every rank scores its own classes for the
rows of all ranks, and the per-shard ranks and top-k lists are merged by collectives.
An unsharded head takes the interface's chunked evaluation unchanged."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..heads.ranking import count_at_or_above, target_scores_of_chunks, topk_of_chunks
from ..heads.targets import check_class_ids, check_k
from .blocks import row_blocks


class ShardedEvaluation:
    """Evaluation over shards, as methods of ``FactoredSphericalHead``."""

    def score_chunks(self, hidden: Tensor, chunk_size: int = 65536):
        """Scores in chunks of classes (a sharded head: of its own classes only)."""
        if not self.sharded:
            yield from super().score_chunks(hidden, chunk_size)
            return
        Hx, _, _ = self._prepare_everywhere(hidden, None, None)
        yield from self._shard_scores(Hx, chunk_size)

    def _gather_eval(self, hidden: Tensor, target_idx: Tensor | None):
        """Checked inputs; a sharded head evaluates all ranks' rows together (each rank
        scores its own classes) and returns this rank's rows in them."""
        Hx, idx, _ = self._prepare_everywhere(hidden, target_idx, None)
        if not self.sharded or self.processes.pg.world == 1:
            return Hx, idx, None
        if idx is None:
            (Hx,), rows = self.processes.pg.gather_rows([Hx], [0.0])
        else:
            (Hx, idx), rows = self.processes.pg.gather_rows([Hx, idx], [0.0, -1])
        return Hx, idx, rows

    def _shard_scores(self, Hx: Tensor, chunk_size: int):
        with torch.autocast(self.device.type, enabled=False):  # not across the yield: the caller's own
            HUt, ht = Hx @ self.U.T, (Hx @ self.omega)[:, None]
        blocks = row_blocks(self.V, chunk_size) if self.V.shape[0] else [(0, self.V)]  # empty shard: one empty chunk
        for a, blk in blocks:
            with torch.autocast(self.device.type, enabled=False):
                sc = self.loss_fn.score(torch.addmm(ht, HUt, blk.T))  # the loss's own score
            yield self.row_lo + a, sc

    @torch.no_grad()
    def target_rank(self, hidden: Tensor, target_idx: Tensor, chunk_size: int = 65536) -> Tensor:
        if not self.sharded:
            return super().target_rank(hidden, target_idx, chunk_size)
        target_idx = check_class_ids(target_idx, hidden.shape[0], self.num_classes)
        Hx, tidx, rows = self._gather_eval(hidden, target_idx)
        tidx = tidx[:, 0]  # padding (-1) rows get a rank too: callers drop them
        # The target's score from its owner shard (0 elsewhere), then the counts of every shard.
        target = self.processes.pg.all_reduce_(target_scores_of_chunks(self._shard_scores(Hx, chunk_size), tidx))
        count = self.processes.pg.all_reduce_(count_at_or_above(self._shard_scores(Hx, chunk_size), tidx, target))
        return (1 + count) if rows is None else (1 + count)[rows]

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int, chunk_size: int = 65536) -> tuple[Tensor, Tensor]:
        """The k best classes of each row: (scores, class ids), (m, k) each, best first.
        A sharded head merges every shard's own top k."""
        if not self.sharded:
            return super().topk(hidden, k, chunk_size)
        check_k(k)
        Hx, _, rows = self._gather_eval(hidden, None)
        best, ids = topk_of_chunks(self._shard_scores(Hx, chunk_size), k)
        k_local = best.shape[1]
        if self.processes.pg.world > 1:
            k_all = self.processes.pg.all_gather_ints([k_local], self.device)[:, 0]
            pad = int(k_all.max())
            best = torch.cat([best, best.new_full((best.shape[0], pad - k_local), -math.inf)], 1)
            ids = torch.cat([ids, ids.new_full((ids.shape[0], pad - k_local), -1)], 1)
            (best, ids), _ = self.processes.pg.gather_rows([best.T.contiguous(), ids.T.contiguous()], [0.0, 0])
            best, pos = best.T.topk(min(k, self.num_classes), dim=1)  # shard blocks side by side
            ids = ids.T.gather(1, pos)
            best, ids = best[rows], ids[rows]
        return best[:, :k], ids[:, :k]
