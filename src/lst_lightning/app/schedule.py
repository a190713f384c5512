"""The learning-rate schedule of the body (and of the self-updating head, which follows
it): linear warm-up, then constant, linear or cosine decay, as a multiple of the base lr."""
from __future__ import annotations

import math


def lr_factor(step: int, *, name: str, warmup_steps: int, total_steps: int, min_factor: float) -> float:
    """The schedule as a multiple of the base lr (linear warm-up, then constant,
    linear or cosine decay to ``min_factor``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant" or total_steps <= warmup_steps:
        return 1.0
    t = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if name == "linear":
        return 1.0 - (1.0 - min_factor) * t
    if name == "cosine":
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"scheduler.name must be constant, linear or cosine, not {name!r}")
