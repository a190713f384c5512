"""Proposal distributions over classes for sampled softmax.

A sampler draws negative classes and reports their log-probability under the
distribution it actually drew from, which the sampled softmax needs for its
logit correction. Two kinds:

- unconditional (``conditional = False``): q does not depend on the hidden
  row; ``sample(S)`` gives S ids shared by the whole batch, (S,);
- conditional (kernel and exact samplers): q depends on the hidden row and
  on the class embeddings, which the head hands over with ``sync``;
  ``sample(S, hidden)`` gives (m, S) ids.
"""
from __future__ import annotations

from torch import Tensor, nn


class Sampler(nn.Module):
    """Base class of the proposals."""

    #: True when q depends on the hidden row (then sample/log_prob take ``hidden``).
    conditional: bool = False
    #: True when the sampler reads the class embeddings (the head calls ``sync``).
    needs_embeddings: bool = False

    num_classes: int

    def sample(self, num_samples: int, hidden: Tensor | None = None, generator=None) -> tuple[Tensor, Tensor]:
        """Draw with replacement: ``(ids, log_q)``, each (S,) or (m, S) for conditional samplers."""
        raise NotImplementedError

    def log_prob(self, classes: Tensor, hidden: Tensor | None = None) -> Tensor:
        """log q of the given class ids; for conditional samplers ``classes`` is (m, K)."""
        raise NotImplementedError

    def sync(self, embeddings: Tensor, bias: Tensor | None = None, rows: Tensor | None = None) -> None:
        """Take the current class embeddings (all of them, or only ``rows``, whose new
        values ``embeddings`` then holds)."""
        raise NotImplementedError(f"{type(self).__name__} reads no class embeddings")


def check_num_samples(num_samples) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    return num_samples
