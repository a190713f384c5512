"""litgpt's ``GPT`` trained through the factored head: one call, ``factor_gpt_head``.

``factor_gpt_head(model, **head_kwargs)`` puts a ``FactoredSphericalHead`` (at its defaults:
lst-train's head, ``loss="sampled"`` with sampled classes and the preconditioner) whose
initial W is ``lm_head.weight`` (its bias as the bias column: ``lm_head_bias`` configs) at ``model.factored_head``, makes ``model.lm_head`` an identity (so litgpt's own
forward, untouched, ends at the body's last norm) and gives the model a forward with one
more argument: ``model(idx, targets=targets)`` returns the head's loss, litgpt's
convention (``targets`` already aligned with ``idx``, as litgpt's loops slice them;
``-100`` ignored; the mean over real tokens, as ``litgpt.utils.chunked_cross_entropy``;
evaluated without grad, ``loss="sampled"`` is that cross-entropy of softmax(o) itself).
Without targets (without grad, or in eval mode) it returns the outputs o = W h as litgpt's
logits (made in chunks of the vocabulary from the factors; a list of chunks along the sequence
with ``lm_head_chunk_size``), so ``litgpt.generate`` works on the patched model; they carry no
gradient, so a training forward without targets is refused. The head has
D = ``config.padded_vocab_size`` classes, the shape of litgpt's lm_head.
``export_dense_head(model)`` gives back an ordinary ``GPT`` (docs/integrations.md).
litgpt is not imported here: the patch reads the model's attributes only.
"""
from __future__ import annotations

import functools
import types

from torch import Tensor, nn

from ..spherical import FactoredSphericalHead
from .hf import (PATCH, body_dtype, check_training_has_labels, dense_outputs, head_from_linear, outputs_nll,
                 scored_by_outputs, tied)
from .processes import check_not_fsdp1, ddp_ignores_head, join_processes, whole_v_into


def check_gpt_patchable(model: nn.Module) -> nn.Linear:
    """The ``lm_head`` linear layer of a litgpt ``GPT``, or one clear ValueError saying why the
    model cannot take the factored head. Reads the model only."""
    name = type(model).__name__
    if getattr(model, PATCH, None) is not None:
        raise ValueError(f"{name} already has the factored head (export_dense_head() undoes it)")
    head, config = getattr(model, "lm_head", None), getattr(model, "config", None)
    wte = getattr(getattr(model, "transformer", None), "wte", None)
    if not isinstance(head, nn.Linear) and isinstance(getattr(head, "linear", None), nn.Linear):
        if getattr(head, "r", None) == 0:  # litgpt.lora's LoRALinear without LoRA (lora_head=False): its linear
            head = head.linear
        else:
            raise ValueError(f"{name}'s lm_head wraps its linear layer in {type(head).__name__} with weights of its "
                             "own (litgpt.lora's lora_head=True, or litgpt.adapter_v2's model), which the factored head "
                             "cannot replace: set lora_head=False (the factored head trains all of W itself), merge "
                             "the LoRA weights first (litgpt merge_lora), or patch litgpt.adapter's GPT, whose lm_head "
                             "is linear")
    if not isinstance(head, nn.Linear) or not isinstance(wte, nn.Embedding) or config is None:
        raise ValueError(f"{name} is not a litgpt GPT (an lm_head nn.Linear, transformer.wte and a config): "
                         f"found lm_head {type(head).__name__}")
    if tied(head.weight, wte.weight):
        raise ValueError(f"{name} ties lm_head to transformer.wte: the factored head owns W and updates it itself "
                         "in backward, so the input embedding would no longer be tied; give lm_head its own copy "
                         "first: model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())")
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        raise ValueError(f"{name}'s config has final_logit_softcapping={cap}: the spherical losses are functions of "
                         "the linear outputs o = W h, not of cap * tanh(o / cap); set "
                         "config.final_logit_softcapping = None (training from scratch) or use another model")
    return head


def factor_gpt_head(model: nn.Module, **head_kwargs) -> nn.Module:
    """Put a ``FactoredSphericalHead`` (with ``head_kwargs``, any of its arguments: ``loss``,
    ``lr``, ``negatives``...; its defaults are lst-train's head) at ``model.factored_head``,
    starting from ``model.lm_head``'s weight, and patch ``model.forward`` to take ``targets``.
    On a GPU its step is compiled and reads its checks every ``sync_every`` steps; a loop that
    backpropagates the loss unscaled on one process, without accumulation, replays it from a
    CUDA graph with ``step="cuda_graph"`` (the patch cannot see the loop). Returns the model,
    changed in place; an unsupported model raises one ValueError and is left unchanged."""
    linear = check_gpt_patchable(model)
    head = head_from_linear(linear, head_kwargs, "factor_gpt_head", reduction="mean_real")
    #: whole_v: a sharded V gathered for the next checkpoint (gather_head_for_checkpoint); wrapper:
    #: litgpt.lora's LoRALinear without LoRA, emptied (its linear's D x d gone), which export fills again
    wrapper = model.lm_head if model.lm_head is not linear else None
    patch = types.SimpleNamespace(linear_dtype=linear.weight.dtype, body_dtype=body_dtype(model), whole_v=None,
                                  wrapper=wrapper)
    if wrapper is not None:
        wrapper.linear = nn.Identity()
    head.register_state_dict_post_hook(functools.partial(whole_v_into, patch))
    setattr(model, PATCH, patch)
    model.factored_head = head
    model.lm_head = nn.Identity()  # litgpt's forward then returns the body's last hidden states
    # an instance attribute (export deletes it); a partial, which pickles by reference, not a bound method
    model.forward = functools.partial(_forward, model)
    ddp_ignores_head(model, "factored_head", head)  # several processes: the head keeps its replicas itself
    return model


def gpt_loss(head: FactoredSphericalHead, hidden: Tensor, targets: Tensor) -> Tensor:
    """The head's loss with litgpt's alignment (hidden[:, t] predicts targets[:, t]), the mean
    over real (non -100) targets (without grad, ``loss="sampled"``'s cross-entropy of softmax(o),
    ``scored_by_outputs``); on several processes over the world's, the same on every rank
    (each rank's dL/dH for its rows scaled by the world size, which DDP's and FSDP's averages of
    the body's gradients undo)."""
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have the shape of idx {tuple(hidden.shape[:-1])} (litgpt's loops pass "
                         f"them already shifted), got {tuple(targets.shape)}")
    H, y = hidden.reshape(-1, hidden.shape[-1]), targets.to(hidden.device).reshape(-1)
    if scored_by_outputs(head):  # evaluation of loss="sampled": the cross-entropy of softmax(o), as litgpt's
        nll, real = outputs_nll(head, H, y)
        return nll / real.clamp(min=1)
    if head.in_training_step:
        join_processes(head)  # several processes (Fabric's DDP or FSDP2): the world's rows, one global step
    return head(H, y)


def _forward(self, idx: Tensor, input_pos: Tensor | None = None, input_pos_maxp1: int | None = None,
             lm_head_chunk_size: int = 0, targets: Tensor | None = None):
    """The patched forward: litgpt's own (lm_head is an identity: the hidden states), then the
    factored head's loss with ``targets``, or the outputs o as logits without."""
    check_training_has_labels(self, targets, "targets", "use model(idx, targets=targets) as the loss in place of "
                              "chunked_cross_entropy(model(idx), targets)")
    if targets is not None and self.factored_head.in_training_step:
        check_not_fsdp1(self)  # Fabric's FSDPStrategy: one line on every rank, before any step
    hidden = type(self).forward(self, idx, input_pos, input_pos_maxp1)
    if targets is not None:
        return gpt_loss(self.factored_head, hidden, targets)
    logits = dense_outputs(self.factored_head, hidden).to(hidden.dtype)
    return list(logits.split(lm_head_chunk_size, dim=1)) if lm_head_chunk_size > 0 else logits
