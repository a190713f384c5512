"""How the factored head's step is driven: one validated value (``head.driving``), checked once.

``step`` says where the update runs ("autograd": inside ``loss.backward()``; "fused":
forward, backward and update in the forward; "cuda_graph": that fused step replayed from
one CUDA graph), ``sync_every`` how often the step's device flags are read on the host
(1: at once; N > 1: every N steps, the step never waits for the GPU), ``parallel`` how
many processes share the head. Each field is checked here; their combinations are refused by plan.py's
``driving_refusal``, which this value calls when it is made: the head, ``CudaGraphStep``,
``attach`` and the app ask this value. The step modes and the
parallel modes are declared here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

from .batch_shapes import check_batch_sizes
from .plan import accumulate_refusal, driving_refusal

STEP_MODES = ("autograd", "fused", "cuda_graph")
#: how often the step's device flags are read on the host by default: one host
#: synchronisation every 64 steps (driver.py's ``DeviceFlags``; 1 reads each check as it is made)
SYNC_EVERY = 64
PARALLEL_MODES = ("none", "replicated", "sharded")
#: ``compile``: "auto" (on a CUDA device, where nothing refuses it), True (required: a head whose
#: step cannot compile raises, with the reason) or False (the eager step)
COMPILE_MODES = ("auto", True, False)
#: the batch sizes a compiled step pads its rows to, so that any m compiles once per size
#: (batch_shapes.py): "pow2" (16, 32, 64, ...) or a sequence of sizes (past the largest: pow2's)
BATCH_SIZES = "pow2"


@dataclass(frozen=True)
class Driving:
    step: str = "autograd"
    sync_every: int = SYNC_EVERY
    parallel: str = "none"
    #: the step's device part compiled whole (driver.py): "auto" (on a CUDA device), True, False
    compile: bool | str = "auto"
    #: the rows a compiled step pads a batch to (batch_shapes.py): "pow2" or a sequence of sizes
    batch_sizes: str | tuple[int, ...] = BATCH_SIZES

    def __post_init__(self):
        if self.step not in STEP_MODES:
            raise ValueError(f"step must be one of {STEP_MODES}, not {self.step!r}")
        if isinstance(self.sync_every, bool) or not (isinstance(self.sync_every, int) and self.sync_every >= 1):
            raise ValueError(f"sync_every must be an int >= 1, got {self.sync_every!r}")
        if not (isinstance(self.compile, bool) or self.compile == COMPILE_MODES[0]):  # True, False or "auto"
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        object.__setattr__(self, "batch_sizes", check_batch_sizes(self.batch_sizes))
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        why = driving_refusal(self)
        if why is not None:
            raise ValueError(why)

    @property
    def deferred_checks(self) -> bool:
        """The step leaves its checks on the device, read every ``sync_every`` steps."""
        return self.sync_every > 1

    def cannot_accumulate(self) -> str | None:
        """Why a head in this mode cannot wait for the optimizer's step, or None (plan.py)."""
        return accumulate_refusal(self)
