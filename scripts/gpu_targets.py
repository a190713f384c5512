"""The GPU targets of the factored head's step, with no import of torch (the results pages read
them): the size they are set at, each target's bound, and the verdict of a measured value.

``TARGET``: the size (D, d, m) and bench_heads.py's targets there (the Z-loss step's far goal
``max_ms``, the ratios to the fused softmaxes, the memory beyond the parameters, flatness in D);
``MAX_MS``, ``MAX_ROUTE_RATIO``, ``MAX_PADDED_RATIO``: compiled_step.py's.
"""
from __future__ import annotations

TARGET = {"D": 793_471, "d": 512, "m": 1024, "max_ms": 0.2, "vs_lce_bf16": 50.0, "vs_fused": 20.0,
          "max_extra_mb": 64.0, "flat_lo": 10_000, "flat_hi": 20_000_000, "flat_tol": 0.10}
#: at the target size on a GPU: the compiled step's milliseconds with no graph and inside the graph,
#: and the autograd and accumulated steps' (the HF Trainer's, Fabric's routes) against lst-train's graph step
MAX_MS = {"zloss": 0.4, "sampled": 0.6}
MAX_ROUTE_RATIO = 1.2
#: the fused step of m rows padded to its batch size against the step of exactly m rows (any device)
MAX_PADDED_RATIO = 1.15


def verdict(value: float, bound: float) -> str:
    """PASS where ``value`` is at most ``bound``, else FAIL."""
    return "PASS" if value <= bound else "FAIL"
