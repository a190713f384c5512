"""Back to an ordinary model: the trained factored head written as a dense ``lm_head``.

``export_dense_head(model)`` forms W = V U + 1 omega^T once (O(D d^2)), writes it into a
new ``nn.Linear`` lm_head (the bias column as ``lm_head.bias``, which the layer gets if the
head has a bias) and gives the model back its class's own forward: ``generate()``,
``save_pretrained()`` and any serving stack see an ordinary model whose logits are the
head's outputs o = W h.

Which losses give a probability to sample from (docs/integrations.md): the spherical
softmax (p_i proportional to o_i^2 + eps) and the Taylor softmax (p_i proportional to
1 + o_i + o_i^2 / 2). Their probability is softmax(log numerator), exactly, so
``SphericalSampling(loss)`` (a transformers ``LogitsProcessor``) turns the exported
logits o into logits whose softmax is the head's p, for sampling and for greedy search
(argmax of p, which is not argmax of o: a large negative o is likely too). The Z-loss
and the squared error define no probability: greedy search by o (the exported logits
as they are) is their ranking; softmax(o) is not their model. The composite loss with a
sampled-softmax term (``loss="sampled"``) trains o as logits: an exported model
samples from softmax(o) in ``generate()`` as it is (``SphericalSampling`` leaves o alone).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..losses import SphericalLoss
from .hf import PATCH, factored_head, lm_head_dtype
from .processes import ddp_forgets_head, every_rank_classes


@torch.no_grad()
def export_dense_head(model: nn.Module) -> nn.Module:
    """Replace the factored head of a model patched by ``factor_lm_head`` or ``factor_gpt_head``
    with an ordinary ``nn.Linear`` lm_head holding W (and the bias column), in the dtype of
    the original lm_head (the model's, where the model was cast since the patch), and restore
    the class's forward. Returns the model, changed in place.
    A head sharded over several processes: every rank calls it and gets the whole W."""
    head = factored_head(model)
    W = head.weight()
    if W.shape[0] != head.num_classes:  # a sharded head on several processes: every rank's rows
        W = every_rank_classes(head, W.T).T
    patch = getattr(model, PATCH)
    linear = nn.Linear(head.hidden_dim, head.num_classes, bias=head.bias, device=W.device, dtype=lm_head_dtype(model))
    linear.weight.copy_(W[:, : head.hidden_dim])
    if head.bias:
        linear.bias.copy_(W[:, head.hidden_dim])
    wrapper = getattr(patch, "wrapper", None)  # litgpt.lora's LoRALinear without LoRA: the layer in it again
    if wrapper is not None:
        wrapper.linear, linear = linear, wrapper
    model.lm_head = linear
    prefix = "lm_head"
    if getattr(model, "factored_head", None) is head:  # litgpt's GPT (factor_gpt_head)
        del model.factored_head
        prefix = "factored_head"
    del model.forward  # the instance attribute factor_lm_head set: the class's forward again
    vars(model).pop("resize_token_embeddings", None)  # factor_lm_head's refusal: the class's own again
    vars(model).pop("save_pretrained", None)  # and its save: the class's own
    ddp_forgets_head(model, prefix)
    delattr(model, PATCH)
    return model


def sampling_logits(loss: SphericalLoss, logits: Tensor) -> Tensor:
    """Logits whose softmax is the loss's probability, from the outputs o: log of its
    numerator (spherical softmax o^2 + eps, Taylor 1 + o + o^2/2). ValueError for a loss
    with no probability (Z-loss, squared error: rank by o itself). The composite loss with a
    sampled-softmax term (``loss="sampled"``) trains o as logits: its distribution is
    softmax(o), the exported logits as they are."""
    if loss.outputs_are_logits:
        return logits
    if not loss.normalised:
        raise ValueError(f"the {loss.name} loss defines no probability to sample from: use greedy search on the "
                         "exported logits o (do_sample=False), its own ranking")
    return torch.log(loss.score(logits.float()))  # score: the numerator, positive for both losses


def SphericalSampling(loss: SphericalLoss):  # noqa: N802 (a class factory: transformers is imported lazily)
    """A transformers ``LogitsProcessor`` (``generate(..., logits_processor=[...])``) that turns
    the exported logits o into ``sampling_logits``: sampling and greedy search then follow p."""
    from transformers import LogitsProcessor

    class _Processor(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return sampling_logits(loss, scores)

    sampling_logits(loss, torch.zeros(1))  # refuse a loss without a probability now, not at generate()
    return _Processor()
