"""Proposal distributions over classes for sampled classes, shared by the sampled-softmax
baseline (``lst_lightning.baselines.samplers``, the registry by name) and the exact head's
sampled slots (``lst_lightning.spherical.negatives``): the base class and the static
proposals (uniform, log-uniform, unigram), torch only; the kernel proposals are in
``kernel_sampler.py``.

A sampler draws negative classes and reports their log-probability under the
distribution it actually drew from, which the sampled softmax needs for its
logit correction. Two kinds:

- unconditional (``conditional = False``): q does not depend on the hidden
  row; ``sample(S)`` gives S ids shared by the whole batch, (S,);
- conditional (kernel and exact samplers): q depends on the hidden row and
  on the class embeddings, which the head hands over with ``sync``;
  ``sample(S, hidden)`` gives (m, S) ids.

The static proposals are each a table of D probabilities, sampled by inverse CDF (one
searchsorted, no per-draw Python).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def check_class_counts(class_counts, num_classes: int) -> Tensor:
    """A float64 copy of the counts after checking shape and values."""
    if not isinstance(class_counts, Tensor):
        class_counts = torch.as_tensor(class_counts)
    if class_counts.shape != (num_classes,):
        raise ValueError(f"class_counts must have shape ({num_classes},), got {tuple(class_counts.shape)}")
    counts = class_counts.detach().to("cpu", torch.float64)
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("class_counts must be finite and non-negative")
    if counts.sum() <= 0:
        raise ValueError("class_counts must not all be zero")
    return counts


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


#: S, the classes a step samples, when a head leaves it null: the sampled softmax
#: (``SampledSoftmaxHead``) and the exact head's slots (``negatives.num``) alike, 64 below
#: ``LARGE_D`` classes and 512 from there; from ``HUGE_D`` classes the sampled softmax takes
#: ``HUGE_D_NUM_SAMPLES`` (``sampled_softmax_num_samples``), the exact head's slots from
#: ``SLOTS_HUGE_D`` (``slots_num_samples``). Each is its head's best for the same training time
#: with the lr decaying over it (docs/results/equal_time.md, "Every setting run"): at 10^6 the
#: sampled softmax at S 1024 ahead of S 512, the slots at S 512 ahead of S 1024; at 10^7 the
#: slots at S 1024 ahead of S 512; at 10^5 S 512 and 1024 level for the sampled softmax.
SMALL_D_NUM_SAMPLES, LARGE_D, LARGE_D_NUM_SAMPLES = 64, 100_000, 512
HUGE_D, HUGE_D_NUM_SAMPLES = 1_000_000, 1024
SLOTS_HUGE_D = 10_000_000


def default_num_samples(num_classes: int) -> int:
    """S for D = ``num_classes`` classes (``SMALL_D_NUM_SAMPLES`` / ``LARGE_D_NUM_SAMPLES``)."""
    return LARGE_D_NUM_SAMPLES if num_classes >= LARGE_D else SMALL_D_NUM_SAMPLES


def sampled_softmax_num_samples(num_classes: int) -> int:
    """The sampled softmax's S for D classes: ``default_num_samples``, and ``HUGE_D_NUM_SAMPLES``
    from ``HUGE_D`` classes."""
    return HUGE_D_NUM_SAMPLES if num_classes >= HUGE_D else default_num_samples(num_classes)


def slots_num_samples(num_classes: int) -> int:
    """The exact head's sampled slots' S for D classes: ``default_num_samples``, and
    ``HUGE_D_NUM_SAMPLES`` from ``SLOTS_HUGE_D`` classes."""
    return HUGE_D_NUM_SAMPLES if num_classes >= SLOTS_HUGE_D else default_num_samples(num_classes)


def check_num_samples(num_samples) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    return num_samples


class StaticSampler(Sampler):
    """q given by a fixed table of probabilities (float64, normalised)."""

    def __init__(self, probs: Tensor):
        super().__init__()
        probs = probs.to(torch.float64)
        if probs.dim() != 1 or probs.numel() < 1 or not torch.isfinite(probs).all() or (probs < 0).any():
            raise ValueError("a static proposal needs a 1-D table of finite non-negative weights")
        if not probs.sum() > 0:
            raise ValueError("a static proposal needs a positive total weight")
        probs = probs / probs.sum()
        self.num_classes = probs.numel()
        self.register_buffer("log_q", probs.log())
        self.register_buffer("cdf", torch.cumsum(probs, 0))

    def sample(self, num_samples, hidden=None, generator=None):
        idx, log_q = self.at(self.uniforms(check_num_samples(num_samples), generator))
        return idx, log_q.float()

    def uniforms(self, num_samples: int, generator=None) -> Tensor:
        """The randomness of a draw of ``num_samples``: uniforms in [0, 1), float64, on the
        table's device. Drawn apart from ``at`` so that a compiled step, which cannot take a
        ``torch.Generator``, is handed them."""
        return torch.rand(num_samples, dtype=torch.float64, device=self.cdf.device, generator=generator)

    def at(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """The classes drawn by the uniforms ``u`` (inverse CDF) and their log q in float64 (``sample``
        gives it in float32)."""
        idx = torch.searchsorted(self.cdf, u * self.cdf[-1], right=True).clamp_(max=self.num_classes - 1)
        return idx, self.log_q[idx]

    def log_prob(self, classes, hidden=None):
        return self.log_q[classes.clamp(min=0)].float()


class UniformSampler(StaticSampler):
    def __init__(self, *, num_classes: int):
        super().__init__(torch.ones(num_classes))


class LogUniformSampler(StaticSampler):
    """Zipf law over ids sorted by decreasing frequency: q(k) = log((k+2)/(k+1)) / log(D+1)."""

    def __init__(self, *, num_classes: int):
        k = torch.arange(num_classes, dtype=torch.float64)
        super().__init__(torch.log1p(1.0 / (k + 1)) / math.log(num_classes + 1))


class UnigramSampler(StaticSampler):
    """q proportional to count^power (0.75 as in word2vec); classes never seen get ``smoothing``."""

    def __init__(self, *, num_classes: int, class_counts: Tensor, power: float = 0.75, smoothing: float = 0.0):
        if class_counts is None:
            raise ValueError("the unigram sampler needs class_counts")
        for name, v in (("power", power), ("smoothing", smoothing)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        counts = check_class_counts(class_counts, num_classes)
        super().__init__((counts + smoothing) ** power)
        self.power = float(power)


#: the static proposals by name
STATIC_SAMPLERS: dict[str, type[StaticSampler]] = {
    "uniform": UniformSampler,
    "log_uniform": LogUniformSampler,
    "unigram": UnigramSampler,
}
