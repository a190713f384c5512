"""The factored step's device part compiled whole (``compile``; docs/factored_head.md,
"The compiled step").

Under device flags (``sync_every > 1``) a step splits into a host part that reads nothing on
the device (exact_step.py's ``before_step``: the device lr, the sampled classes' uniforms;
``run_device_part``: the version, moved before the device part, the tick of the flags after it) and a device
part, a function of the plan and tensors that takes no head (``device_step``: forward, dL/dH, the
checks as flags, the write; or its halves ``forward`` and ``update`` for the autograd step, and
``records_step`` for exact accumulation). ``run`` calls the device part compiled by
``torch.compile(fullgraph=True)``: one graph (a break is an error, not a silent fallback),
shapes static per graph, lr a device
scalar (a new lr is no recompile); a batch is padded to one of a few sizes first
(batch_shapes.py), so that any m compiles once per size.
Inductor fuses the step's few hundred small operators into a few dozen kernels.
"""
from __future__ import annotations

import inspect

import torch

#: ``compile``: "auto" (on a CUDA device, where nothing refuses it), True (required: a head whose
#: step cannot compile raises, with the reason) or False (the eager step)
COMPILE_MODES = ("auto", True, False)

#: Dynamo's limit of graphs per compiled function and head while the step runs: each batch size
#: (batch_shapes.py) of m and K, and each number of Neumann factors, is one; a run meets a few dozen
RECOMPILE_LIMIT = 64

_compiled: dict = {}


def compiled(fn):
    """``fn`` compiled whole, once per function: ``fullgraph`` (a graph break raises), static
    shapes, without autograd. The function itself is compiled, not its ``torch.no_grad()``
    wrapper, whose one code object every wrapped function shares (and with it Dynamo's cache
    and its limit of recompiles)."""
    out = _compiled.get(fn)
    if out is None:
        out = _compiled[fn] = torch.no_grad()(torch.compile(inspect.unwrap(fn), fullgraph=True, dynamic=False))
    return out


def run(plan, fn, *args):
    """``fn(*args)``, one of exact_step.py's device parts (a function of the plan and tensors):
    compiled where the plan says, with Dynamo's limit of graphs per function at ``RECOMPILE_LIMIT``
    (a graph per batch size, batch_shapes.py, and Neumann factors: more than Dynamo's default of 8
    in a long run)."""
    if not plan.compiled:
        return fn(*args)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return compiled(fn)(*args)
