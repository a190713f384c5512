"""The learning-rate schedule of the body (and of the self-updating head, which follows
it): linear warm-up, then constant, linear or cosine decay, as a multiple of the base lr.

The decay spans the training budget (``scheduler.over``): ``budget`` (the default) follows
whichever of the budgets runs out first, the steps (``trainer.max_steps``, or the epochs)
or the time (``trainer.max_time``, read from Lightning's own ``Timer``, whose elapsed time a
resumed run restores); ``steps`` follows the steps alone, so a run's lr never depends on the
clock."""
from __future__ import annotations

import math

OVER = ("budget", "steps")


def lr_factor(step: int, *, name: str, warmup_steps: int, total_steps: float, min_factor: float,
              over: str = "budget", time_spent: float = 0.0) -> float:
    """The schedule as a multiple of the base lr (linear warm-up, then constant, linear or
    cosine decay to ``min_factor``). The decay's progress is the larger of the steps' share
    ``(step - warmup_steps) / (total_steps - warmup_steps)`` and, over the budget,
    ``time_spent`` (the share of ``trainer.max_time`` spent; 0 without one)."""
    if name not in ("constant", "linear", "cosine"):
        raise ValueError(f"scheduler.name must be constant, linear or cosine, not {name!r}")
    if over not in OVER:
        raise ValueError(f"scheduler.over must be one of {OVER}, not {over!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    t = (step - warmup_steps) / (total_steps - warmup_steps) if total_steps > warmup_steps else 0.0
    t = min(1.0, max(t, time_spent) if over == "budget" else t)
    if name == "linear":
        return 1.0 - (1.0 - min_factor) * t
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))
