"""``head.step=auto``, the app's choice of where the factored head's step runs.

On one CUDA device, where nothing refuses it, the step is replayed from a CUDA graph with
its device flags read on the host every ``GRAPH_SYNC_EVERY`` steps (or every
``head.sync_every`` steps where that is above 1); elsewhere it is the autograd step. Eager on
a GPU, the step is bound by the host (about 260 kernel launches and a host read a step);
replayed from a graph it is bit for bit the eager sync-free step (tests/spherical/test_cuda.py)
and took twice the steps in the same 15 s at D = 10^6 on an H200 (docs/results/quality.md).
``head.step=autograd`` (or ``fused``, ``cuda_graph``) chooses by hand.
"""
from __future__ import annotations

import logging

AUTO = "auto"
#: how often a step replayed from a CUDA graph reads its device flags on the host, where
#: head.sync_every is left at 1
GRAPH_SYNC_EVERY = 64

log = logging.getLogger(__name__)


def graph_refusal(trainer) -> str | None:
    """Why this run cannot replay the head's step from a CUDA graph, or None."""
    accumulate = trainer.accumulate_grad_batches
    device = trainer.strategy.root_device
    if device.type != "cuda":
        return f"it trains on {device.type}"
    if trainer.world_size > 1:
        return f"{trainer.world_size} processes exchange the head's data each step"
    if accumulate != 1:
        return f"trainer.accumulate_grad_batches={accumulate} steps at the optimizer's step"
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return "a loss scaler (fp16) steps at the optimizer's step"
    return None


def choose_step(head, trainer) -> None:
    """Set ``head.step`` (and ``head.sync_every``) for ``head.step=auto``: from a CUDA graph
    where ``graph_refusal`` finds nothing and the head takes it, else autograd; the choice
    logged where the run trains on a GPU."""
    why = graph_refusal(trainer)
    if why is None:
        sync_every = head.sync_every
        try:
            head.sync_every = sync_every if sync_every > 1 else GRAPH_SYNC_EVERY
            head.step = "cuda_graph"
        except ValueError as e:  # the head's own refusal (a sampler whose tables stay on the host)
            head.sync_every = sync_every
            why = str(e)
    if why is None:
        log.info("head.step=auto: the head's step replayed from a CUDA graph, its flags read every %d steps "
                 "(head.step=autograd for the eager step)", head.sync_every)
    else:
        head.step = "autograd"
        if trainer.strategy.root_device.type == "cuda":
            log.info("head.step=auto: the autograd step, not a CUDA graph: %s", why)
