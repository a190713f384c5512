"""``compile``: the body and an ordinary head compiled by ``torch.compile`` (docs/app.md,
"Compiling the model").

- ``auto`` (the app's default): on one CUDA device, what can be compiled whole is, the rest runs
  eager (the log says which and why); elsewhere nothing (on the CPU the compiled step was not
  faster: docs/app.md);
- ``true``: on any device; a body or head that cannot be compiled whole is refused, in one line,
  before training;
- ``false``: nothing compiled;
- a mode of ``torch.compile`` (``default``, ``reduce-overhead``, ``max-autotune``,
  ``max-autotune-no-cudagraphs``): ``true`` in that mode. Otherwise the mode is
  ``reduce-overhead`` on CUDA (CUDA graphs replay the compiled forward and backward) and torch's
  default elsewhere.

What is compiled: the body's forward and the head's forward in training, each whole
(``fullgraph``: a graph break is an error) in static shapes (a batch of another shape, an epoch's
last, compiles one graph more), and ``RowAdam``'s update of the row-sparse tables (static rows:
``optimizer.embedding=row_adam``, ``lst_lightning.rows``). Evaluation stays eager. The first
training step runs eager: it sizes the static rows and reads its batch's checks on the host once;
the compiled forwards take over from the second. A self-updating head is left out of the graph:
the factored head compiles its own step (``head.compile_step``). Under compilation a head leaves
its host checks to the loop, which reads the loss for non-finite values every few steps
(``LanguageModel``). Under CUDA graphs (``reduce-overhead``, ``max-autotune``) each training step
is one generation of torch's CUDA graph trees (``Compiled.begin_step``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..heads.base import OutputHead

AUTO = "auto"
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the mode on a CUDA device when the setting names none: CUDA graphs over the compiled graphs
CUDA_MODE = "reduce-overhead"
#: the modes whose compiled graphs replay from CUDA graphs (torch's CUDA graph trees)
GRAPHED_MODES = ("reduce-overhead", "max-autotune")

log = logging.getLogger(__name__)


def _shown(setting) -> str:
    return str(setting).lower() if isinstance(setting, bool) else str(setting)


def check_setting(setting) -> None:
    if setting not in (AUTO, True, False) and setting not in MODES:
        raise ValueError(f"compile must be auto, true, false or a torch.compile mode ({', '.join(MODES)}), "
                         f"not {setting!r}")


@dataclass
class Compiled:
    """What a run compiles: the body, the head, the mode (None: torch's default) and why not the rest."""

    body: bool = False
    head: bool = False
    mode: str | None = None
    why_not: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return self.body or self.head

    @property
    def graphed(self) -> bool:
        """Whether the compiled forwards (and RowAdam's update) replay from CUDA graph trees."""
        return self.any and self.mode in GRAPHED_MODES

    def begin_step(self) -> None:
        """Mark a training step's start for CUDA graph trees (a no-op unless ``graphed``). Left to
        itself, the trees start a new generation at every compiled call that has no backward
        pending, and free the outputs of the last one: RowAdam's compiled update, after the
        backward, would free the row ids and gradients it reads. Marked here, a step (forwards,
        backward, updates) is one generation."""
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()

    def describe(self) -> str:
        parts = [p for p, on in (("body", self.body), ("head", self.head)) if on]
        what = " and ".join(parts) + f" ({self.mode or 'default'} mode)" if parts else "nothing"
        return what + ("; not compiled: " + "; ".join(self.why_not) if self.why_not else "")


def body_refusal(body: nn.Module) -> str | None:
    """Why ``torch.compile`` cannot take ``body`` whole, as far as its modules say, or None."""
    rnn = next((m for m in body.modules() if isinstance(m, nn.RNNBase)), None)
    if rnn is not None:
        return f"{type(body).__name__} holds an nn.{type(rnn).__name__}, which torch.compile does not trace"
    return None


def run_refusal(setting, device: torch.device, world_size: int = 1, accumulate: int = 1) -> str | None:
    """Why ``compile=setting`` compiles nothing on this run whatever its model, or None."""
    if setting is False:
        return "compile=false"
    if accumulate != 1:
        return f"trainer.accumulate_grad_batches={accumulate}: a compiled forward keeps one micro-batch's static rows"
    if setting == AUTO and device.type != "cuda":
        return f"it trains on {device.type} (compile=true compiles there too)"
    if setting == AUTO and world_size > 1:
        return f"{world_size} processes (compile=true compiles there too)"
    return None


def choose(setting, body: nn.Module, head: OutputHead, device: torch.device, world_size: int = 1,
           accumulate: int = 1) -> Compiled:
    """What ``compile=setting`` compiles for this run; ``true`` (or a mode) refuses, in one line, a
    body or an ordinary head that cannot be compiled whole."""
    check_setting(setting)
    if setting is False:
        return Compiled()
    required = setting != AUTO
    mode = setting if setting in MODES and setting != "default" else (CUDA_MODE if device.type == "cuda" and
                                                                      setting in (AUTO, True) else None)
    general = run_refusal(setting, device, world_size, accumulate)
    if general is not None:
        if required:
            raise ValueError(f"compile={_shown(setting)}: {general}; use compile=false")
        return Compiled(why_not=[general])
    why_body = body_refusal(body)
    why_head = None if head.self_updating else head.cannot_compile()
    if required and (why_body or why_head):
        name, why = (type(body).__name__, why_body) if why_body else (type(head).__name__, why_head)
        raise ValueError(f"compile={_shown(setting)}: {name} cannot be compiled whole: {why}; compile=auto compiles what "
                         "can be (on a GPU), compile=false nothing")
    out = Compiled(body=why_body is None, head=not head.self_updating and why_head is None, mode=mode)
    out.why_not += [f"the body: {why_body}"] if why_body else []
    if head.self_updating:
        out.why_not.append(f"the head: {type(head).__name__} steps itself"
                           + (" (its own compiled step)" if head.compiles else ""))
    elif why_head:
        out.why_not.append(f"the head: {why_head}")
    return out


class TrainingForward:
    """A module's ``forward``, compiled for training: outside training (or without autograd) and on
    the first training call eager, compiled from the second (see the module docstring)."""

    def __init__(self, module: nn.Module, mode: str | None):
        self.name = type(module).__name__
        self.module_training = lambda: module.training
        self.eager = module.forward
        self.compiled = torch.compile(self.eager, fullgraph=True, dynamic=False, mode=mode)
        # a CUDA graph's replay writes over its last outputs: the loop keeps its own copy (the
        # loss it logs, the hidden states the head reads), which autograd passes through
        self.copies = mode in GRAPHED_MODES
        self.calls = 0

    def __call__(self, *args, **kwargs):
        if not (self.module_training() and torch.is_grad_enabled()):
            return self.eager(*args, **kwargs)
        self.calls += 1
        if self.calls == 1:
            return self.eager(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:  # a graph break, a host read
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise ValueError(f"compile: {self.name} cannot be compiled whole: {first}; compile=false runs it "
                             "eager") from e
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out) if self.copies else out


def install(body: nn.Module, head: OutputHead, compiled: Compiled) -> None:
    """The chosen forwards replaced by their compiled ``TrainingForward`` (once)."""
    for module, on in ((body, compiled.body), (head, compiled.head)):
        if on and not isinstance(module.__dict__.get("forward"), TrainingForward):
            module.forward = TrainingForward(module, compiled.mode)
