"""``head.step=auto``, the app's choice of how the factored head's step is driven.

The step's device part runs compiled whole on a GPU (``head.compile_step=auto``;
spherical/driver.py), its checks device flags read every ``head.sync_every`` steps. On one
CUDA device, where nothing refuses it, that step is also replayed from a CUDA graph (its
launches in one). On one CPU process without accumulation or a loss scaler it is the fused
step (``head.train_step``'s: the update in the forward, without the autograd step's graph
around it, the same arithmetic); elsewhere (several processes, accumulation, a loss scaler) it is
the autograd step. ``head.step=autograd`` (or ``fused``, ``cuda_graph``) chooses by hand,
``head.compile_step=false`` turns the compilation off.
"""
from __future__ import annotations

import logging

AUTO = "auto"

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


def fused_on_cpu(trainer) -> bool:
    """Whether this run steps the head in the forward on the CPU: one process, no accumulation,
    no loss scaler (each of which waits for the optimizer's step, which the fused step cannot)."""
    return (trainer.strategy.root_device.type == "cpu" and trainer.world_size == 1
            and trainer.accumulate_grad_batches == 1 and getattr(trainer.precision_plugin, "scaler", None) is None)


def choose_step(head, trainer) -> None:
    """Set ``head.step`` for ``head.step=auto``: from a CUDA graph where ``graph_refusal`` finds
    nothing and the head takes it; fused on one CPU process that waits for no optimizer's step
    (``fused_on_cpu``); else autograd; the choice logged where the run trains on a GPU."""
    if fused_on_cpu(trainer):
        head.step = "fused"
        return
    why = graph_refusal(trainer)
    if why is None:
        try:
            head.step = "cuda_graph"
        except ValueError as e:  # the head's own refusal (sync_every=1)
            why = str(e)
    # the head is built on the CPU; its plan follows it to the training device
    compiled = "compiled" if head.compiles_on(trainer.strategy.root_device) else "eager"
    if why is None:
        log.info("head.step=auto: the head's %s step replayed from a CUDA graph, its flags read every %d steps "
                 "(head.step=autograd for the step without a graph)", compiled, head.sync_every)
    else:
        head.step = "autograd"
        if trainer.strategy.root_device.type == "cuda":
            log.info("head.step=auto: the %s autograd step, not a CUDA graph: %s", compiled, why)
