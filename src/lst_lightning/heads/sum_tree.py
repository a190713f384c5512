"""A binary tree of summed class features for kernel-based sampling
(Blanc & Rendle 2018; Rawat et al. 2019, section 3.1).

Classes are grouped in blocks of ``leaf_size`` consecutive ids; the tree's
leaves are the blocks and every node stores the sum of phi(c) over its
classes, so that phi(h) . node = sum of K(h, c) over the node. A draw walks
from the root, going left with probability v_L / (v_L + v_R), then picks a
class inside the block in proportion to its kernel value: O(F log n + B)
per draw instead of O(n F) for the direct way. Node values are clamped at 0
(random-feature kernels can be negative); when both children are 0 the walk
goes by class counts. ``log_q`` is the exact log-probability of this walk,
and ``direct_probs`` computes the same law from scratch in O(n F).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .kernel_functions import Kernel

# Walkers processed at once, bounded so a (walkers, F) gather stays near 64 MB.
_GATHER_BUDGET = 1 << 24


def _branch(vl: Tensor, vr: Tensor, cl: Tensor, cr: Tensor) -> Tensor:
    """P(go left) from the two children's kernel sums, falling back to counts."""
    vl, vr = vl.clamp(min=0), vr.clamp(min=0)
    tot = vl + vr
    by_count = cl / (cl + cr).clamp(min=1)
    return torch.where(tot > 0, vl / torch.where(tot > 0, tot, torch.ones_like(tot)), by_count)


def _within(vals: Tensor, mask: Tensor) -> Tensor:
    """Probabilities inside a block: clamped kernel values, uniform over real classes if all 0."""
    vals = torch.where(mask, vals.clamp(min=0), torch.zeros_like(vals))
    tot = vals.sum(-1, keepdim=True)
    uni = mask.to(vals.dtype) / mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(tot > 0, vals / torch.where(tot > 0, tot, torch.ones_like(tot)), uni)


class KernelSumTree(nn.Module):
    """Sum-tree over n classes for one kernel; ``build`` then ``update`` as embeddings change."""

    def __init__(self, kernel: Kernel, leaf_size: int = 16):
        super().__init__()
        if not isinstance(leaf_size, int) or leaf_size < 1:
            raise ValueError(f"leaf_size must be a positive int, got {leaf_size!r}")
        self.kernel = kernel
        self.leaf_size = leaf_size
        self.num_classes = 0
        for name in ("state", "sums", "counts"):
            self.register_buffer(name, None, persistent=False)

    @property
    def built(self) -> bool:
        return self.sums is not None

    def _block_rows(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        rows = blocks.unsqueeze(-1) * self.leaf_size + torch.arange(self.leaf_size, device=blocks.device)
        return rows, rows < self.num_classes

    @torch.no_grad()
    def build(self, emb: Tensor) -> None:
        """All node sums from the class embeddings (n, d): O(n F)."""
        if emb.dim() != 2 or emb.shape[0] < 1:
            raise ValueError(f"embeddings must have shape (n, d) with n >= 1, got {tuple(emb.shape)}")
        if not torch.isfinite(emb).all():
            raise ValueError("class embeddings contain non-finite values")
        n, B = emb.shape[0], self.leaf_size
        nb = -(-n // B)
        P = 1 << max(nb - 1, 0).bit_length()  # blocks, padded to a power of two
        self.num_classes, self.num_blocks, self.depth = n, P, P.bit_length() - 1
        leaf = self.kernel.leaf_state(emb)
        state = leaf.new_zeros((P * B, *leaf.shape[1:]))
        state[:n] = leaf
        self.state = state
        self.sums = state.new_zeros(2 * P, self.kernel.feature_dim)
        self.counts = torch.zeros(2 * P, dtype=torch.float32, device=emb.device)
        blocks = torch.arange(P, device=emb.device)
        _, mask = self._block_rows(blocks)
        self.counts[P:] = mask.sum(1).float()
        self._refresh_blocks(blocks)
        for lo in reversed([1 << k for k in range(self.depth)]):  # levels, bottom up
            nodes = torch.arange(lo, 2 * lo, device=emb.device)
            self.sums[nodes] = self.sums[2 * nodes] + self.sums[2 * nodes + 1]
            self.counts[nodes] = self.counts[2 * nodes] + self.counts[2 * nodes + 1]

    def _refresh_blocks(self, blocks: Tensor) -> None:
        chunk = max(1, _GATHER_BUDGET // max(self.kernel.feature_dim * self.leaf_size, 1))
        for i in range(0, blocks.numel(), chunk):
            b = blocks[i:i + chunk]
            rows, mask = self._block_rows(b)
            self.sums[self.num_blocks + b] = self.kernel.block_sums(self.state[rows], mask.to(self.state.dtype))

    @torch.no_grad()
    def update(self, rows: Tensor, emb_rows: Tensor) -> None:
        """New embeddings for classes ``rows``: O(|rows| (B + log n) F). Other sums are untouched."""
        if not self.built:
            raise RuntimeError("update() before build()")
        rows = rows.reshape(-1).to(self.state.device)
        if rows.numel() == 0:
            return
        if rows.min() < 0 or rows.max() >= self.num_classes:
            raise ValueError(f"rows must be class ids in [0, {self.num_classes})")
        if emb_rows.shape[0] != rows.numel() or not torch.isfinite(emb_rows).all():
            raise ValueError("emb_rows must hold one finite embedding per row")
        self.state[rows] = self.kernel.leaf_state(emb_rows).to(self.state.dtype)
        nodes = torch.unique(rows // self.leaf_size)
        self._refresh_blocks(nodes)
        nodes = nodes + self.num_blocks
        while nodes[0] > 1:
            nodes = torch.unique(nodes // 2)
            self.sums[nodes] = self.sums[2 * nodes] + self.sums[2 * nodes + 1]

    # -- drawing ---------------------------------------------------------------
    def _chunks(self, total: int):
        per_walker = max(self.kernel.feature_dim, self.leaf_size * self.state[0].numel())
        step = max(1, _GATHER_BUDGET // per_walker)
        for i in range(0, total, step):
            yield slice(i, min(i + step, total))

    def _p_left(self, q: Tensor, node: Tensor) -> Tensor:
        left = 2 * node
        vl = (self.sums[left] * q).sum(-1)
        vr = (self.sums[left + 1] * q).sum(-1)
        return _branch(vl, vr, self.counts[left], self.counts[left + 1])

    def _leaf_probs(self, q: Tensor, h: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
        rows, mask = self._block_rows(block)
        return _within(self.kernel.leaf_values(q, h, self.state[rows]), mask), rows

    @torch.no_grad()
    def sample(self, hidden: Tensor, num_samples: int, generator=None) -> tuple[Tensor, Tensor]:
        """(m, S) class ids drawn for each row of hidden, and their log q (float64)."""
        if not self.built:
            raise RuntimeError("sample() before build()")
        m = hidden.shape[0]
        q_all = self.kernel.query(hidden)
        walker_row = torch.arange(m, device=hidden.device).repeat_interleave(num_samples)
        ids = torch.empty(m * num_samples, dtype=torch.long, device=hidden.device)
        logq = torch.empty(m * num_samples, dtype=torch.float64, device=hidden.device)
        P = self.num_blocks
        for sl in self._chunks(walker_row.numel()):
            r = walker_row[sl]
            node = torch.ones_like(r)
            lq = torch.zeros(r.numel(), dtype=torch.float64, device=r.device)
            for _ in range(self.depth):
                # Walkers of one row at one node share the branch probability: compute it once.
                uk, inv = torch.unique(r * (2 * P) + node, return_inverse=True)
                pl = self._p_left(q_all[uk // (2 * P)], uk % (2 * P))[inv]
                u = torch.rand(r.numel(), device=r.device, generator=generator)
                go_left = u < pl
                node = torch.where(go_left, 2 * node, 2 * node + 1)
                lq += torch.where(go_left, pl, 1 - pl).double().log()
            uk, inv = torch.unique(r * P + (node - P), return_inverse=True)
            ur = uk // P
            p, rows = self._leaf_probs(q_all[ur], hidden[ur], uk % P)
            p, rows = p[inv], rows[inv]
            pick = torch.multinomial(p, 1, generator=generator)
            ids[sl] = rows.gather(1, pick)[:, 0]
            logq[sl] = lq + p.gather(1, pick)[:, 0].double().log()
        return ids.reshape(m, num_samples), logq.reshape(m, num_samples)

    @torch.no_grad()
    def log_prob(self, hidden: Tensor, classes: Tensor) -> Tensor:
        """log q (float64) of classes (m, K) under row j's walk: O(K F log n); padding (-1) gives 0."""
        m, K = classes.shape
        safe = classes.clamp(min=0).reshape(-1)
        q_all = self.kernel.query(hidden)
        walker_row = torch.arange(m, device=hidden.device).repeat_interleave(K)
        out = torch.empty(m * K, dtype=torch.float64, device=hidden.device)
        for sl in self._chunks(walker_row.numel()):
            r, c = walker_row[sl], safe[sl]
            q, h = q_all[r], hidden[r]
            leaf_node = c // self.leaf_size + self.num_blocks
            lq = torch.zeros(r.numel(), dtype=torch.float64, device=r.device)
            for level in range(self.depth):
                node = leaf_node >> (self.depth - level)
                pl = self._p_left(q, node)
                is_left = (leaf_node >> (self.depth - level - 1)) % 2 == 0
                lq += torch.where(is_left, pl, 1 - pl).double().log()
            p, _ = self._leaf_probs(q, h, leaf_node - self.num_blocks)
            out[sl] = lq + p.gather(1, (c % self.leaf_size)[:, None])[:, 0].double().log()
        out = out.reshape(m, K)
        return torch.where(classes >= 0, out, torch.zeros_like(out))

    @torch.no_grad()
    def direct_probs(self, hidden: Tensor) -> Tensor:
        """The walk's law for every class, from the leaf kernel values alone: (m, n), O(n F).

        The reference for ``sample``/``log_prob``: it never reads the node sums.
        """
        m, P, B = hidden.shape[0], self.num_blocks, self.leaf_size
        vals = self.kernel.leaf_values(self.kernel.query(hidden), hidden, self.state)  # (m, P B)
        _, mask = self._block_rows(torch.arange(P, device=hidden.device))
        vals = torch.where(mask.reshape(-1), vals, torch.zeros_like(vals)).double()
        within = _within(vals.reshape(m, P, B), mask)
        level_v, level_c = vals.reshape(m, P, B).sum(2), mask.sum(1).double()
        levels = [(level_v, level_c)]
        while levels[-1][0].shape[1] > 1:
            v, c = levels[-1]
            levels.append((v[:, 0::2] + v[:, 1::2], c[0::2] + c[1::2]))
        prob = torch.ones(m, 1, dtype=torch.float64, device=hidden.device)
        for v, c in reversed(levels[:-1]):  # root's children first
            pl = _branch(v[:, 0::2], v[:, 1::2], c[0::2], c[1::2])
            prob = torch.stack([prob * pl, prob * (1 - pl)], 2).reshape(m, -1)
        return (prob.unsqueeze(2) * within).reshape(m, P * B)[:, :self.num_classes]
