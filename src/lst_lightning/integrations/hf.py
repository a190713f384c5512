"""A Hugging Face causal LM trained through the factored head: one call, ``factor_lm_head``.

``factor_lm_head(model, **head_kwargs)`` replaces the ``lm_head`` linear
layer of a ``*ForCausalLM`` by a ``FactoredSphericalHead`` (at its defaults: lst-train's head,
``loss="sampled"`` with sampled classes and the preconditioner) whose initial W is the
pretrained ``lm_head.weight`` (its bias as the bias column), and gives the model a
forward that returns the head's loss on the model's own shifted labels (position t
predicts labels[t + 1]; ``-100`` is padding, as in transformers). In training the D
logits per token are never made; when they are asked for (labels absent without grad, as
in ``generate()``, or the model in eval mode) they are the outputs ``o = W h``, made in chunks
of the vocabulary, for the last ``logits_to_keep`` positions only (what ``generate()`` asks);
they carry no gradient, so a training forward without labels is refused. The body runs
untouched (``model.base_model``). ``num_items_in_batch`` (the Trainer's exact gradient
accumulation) makes the loss the sum over tokens divided by it; the head's own step
scales with that loss (docs/integrations.md). Evaluated without grad, ``loss="sampled"`` is
scored by the cross-entropy of softmax(o), its probability, over all D classes (the
exported model's loss), not by its spherical terms alone. transformers is imported in the functions
only: the package works without the ``hf`` extra.
"""
from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads.targets import target_slots
from ..heads.user_warning import warn
from ..spherical import FactoredSphericalHead
from ..spherical.blocks import weight_of
from ..spherical.factored import V_ROWS
from .processes import (check_not_fsdp1, ddp_ignores_head, every_rank_classes, gather_for_checkpoint, join_processes,
                        whole_v_into, world_share)

#: the attribute of a patched model holding what ``export_dense_head`` needs to undo the patch
PATCH = "_lst_factored_head"


def check_patchable(model: nn.Module) -> nn.Linear:
    """The model's ``lm_head`` linear layer, or one clear ValueError saying why the model
    cannot take the factored head. Reads the model only."""
    name = type(model).__name__
    if getattr(model, PATCH, None) is not None:
        raise ValueError(f"{name} already has the factored head (export_dense_head() undoes it)")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{name} has no `lm_head` nn.Linear output layer (found {type(head).__name__}): only "
                         "*ForCausalLM models whose output layer is an lm_head linear layer are supported")
    if getattr(model, "base_model", model) is model:
        raise ValueError(f"{name} has no body apart from itself (model.base_model): only *ForCausalLM models "
                         "whose body is their base_model (model.model, model.transformer) are supported")
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    shares = weight is not None and tied(weight, head.weight)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if shares or getattr(text, "tie_word_embeddings", False):
        raise ValueError(f"{name} ties lm_head to the input embedding (tie_word_embeddings=True): the factored head "
                         "owns W and updates it itself in backward, so the input embedding would no longer be tied; "
                         "untie it first with lst_lightning.integrations.untie_lm_head(model) (lm_head gets a copy)")
    check_logits_are_lm_heads(model, name, (config, text))
    check_lm_head_takes_the_body(model, name, head)
    return head


#: the settings with which a transformers model turns lm_head's outputs o into other logits
#: (Gemma's cap tanh(o / cap); Cohere's o * logit_scale; Granite's o / logits_scaling; o times
#: output_multiplier), and the value that leaves o as it is
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                    "output_multiplier": 1.0, "lm_head_multiplier": 1.0}


def check_logits_are_lm_heads(model: nn.Module, name: str, configs) -> None:
    """One ValueError where the model's logits are not lm_head's outputs o: the factored head's
    loss, its logits and the exported lm_head are all o, so patching would train without the
    model's transform and the exported model would apply it to logits trained without it."""
    for key, plain in LOGIT_TRANSFORMS.items():
        for where, owner in (("model", model), ("model.config", configs[0]), ("its text config", configs[1])):
            value = getattr(owner, key, None) if owner is not None else None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value == plain:
                continue
            fix = ("set it to None to train the model without the cap" if plain is None else
                   "fold it into lm_head first (its weight, and its bias, times the factor the logits take) and set it "
                   "to 1.0")
            raise ValueError(f"{name}'s logits are not lm_head's outputs ({where}.{key}={value}): the factored head "
                             "trains and returns lm_head's outputs o, so the model would train without that transform "
                             f"and its exported lm_head would be read through it; {fix} (in model.config, and on the "
                             "model where it keeps its own copy)")


def tied(a: Tensor, b: Tensor) -> bool:
    """Whether two weights are one (tied): the same tensor, or the same memory; on the meta device,
    where every tensor's data_ptr is 0, the same tensor only."""
    return a is b or (not a.is_meta and a.data_ptr() == b.data_ptr())


@torch.no_grad()
def check_lm_head_takes_the_body(model: nn.Module, name: str, head: nn.Linear) -> None:
    """One ValueError where the model's own logits are not ``lm_head`` applied to its body's
    output (``model.base_model(...)[0]``, what the patched forward hands the factored head): a
    norm, a projection or a factor between them that no setting above names. Checked on one
    sequence of two tokens in eval mode (the model's mode put back); a model whose parameters
    are on the meta device (not loaded yet) is not run."""
    if any(p.is_meta for p in model.parameters()):
        return
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    ids = torch.tensor([[0, 1]], device=getattr(embed, "weight", head.weight).device)
    training = model.training
    model.eval()
    try:
        out = model(input_ids=ids, use_cache=False)
        own = head(model.base_model(input_ids=ids, use_cache=False)[0].to(head.weight.device))
    finally:
        model.train(training)
    logits = (out.logits if hasattr(out, "logits") else out[0]).float()
    own = own.float().to(logits.device)[:, -logits.shape[1]:]  # a model that keeps its last positions' logits only
    if logits.shape != own.shape or not torch.allclose(logits, own, rtol=1e-3, atol=1e-3 * float(own.abs().max())):
        raise ValueError(f"{name}'s logits are not lm_head applied to its body's output (model.base_model(...)[0]), "
                         "which is what the factored head takes: the patched model would train and export another "
                         "output layer than its own (a norm, a projection or a factor between the body and lm_head)")


@torch.no_grad()
def untie_lm_head(model: nn.Module) -> nn.Module:
    """Give a model whose lm_head is tied to its input embedding an lm_head of its own (a
    copy of the embedding) and ``tie_word_embeddings=False`` in its config, so that
    ``factor_lm_head`` accepts it. Returns the model, changed in place."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no `lm_head` nn.Linear output layer to untie")
    head.weight = nn.Parameter(head.weight.detach().clone())
    config = getattr(model, "config", None)
    for c in {id(c): c for c in (config, config.get_text_config() if hasattr(config, "get_text_config") else None)
              if c is not None}.values():
        c.tie_word_embeddings = False
    return model


def body_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter: its body's (the head holds none). A
    patched model cast since the patch (``.to(dtype)``, ``.half()``) gets an exported lm_head in
    its new dtype (export.py)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def head_from_linear(linear: nn.Linear, head_kwargs: dict, caller: str,
                     reduction: str = "mean") -> FactoredSphericalHead:
    """A ``FactoredSphericalHead`` whose initial W is ``linear``'s weight (its bias as the bias
    column), in float32 (float64 for a float64 layer) unless ``head_kwargs`` gives a dtype; the
    arguments the patch sets itself are refused. Changes nothing outside the new head. A layer on
    the meta device gives a head there, which refuses every call until it is given a state."""
    for key in ("num_classes", "hidden_dim", "bias", "reduction", "ignore_index"):
        if key in head_kwargs:
            raise ValueError(f"{caller} sets {key} itself (from lm_head and the model's conventions)")
    W = linear.weight.detach()
    kwargs = dict(head_kwargs)
    dtype = kwargs.pop("dtype", torch.float64 if W.dtype == torch.float64 else torch.float32)
    if linear.bias is not None:
        W = torch.cat([W, linear.bias.detach()[:, None]], dim=1)
    head = FactoredSphericalHead(linear.out_features, linear.in_features, bias=linear.bias is not None,
                                 reduction=reduction, dtype=dtype, device=W.device, **kwargs)
    if not W.is_meta:  # a model on the meta device: the head waits for its state (load_state_dict, assign=True)
        head.reset_weight(W.to(dtype))  # validates W (finite) before the model changes
    return head


def factor_lm_head(model: nn.Module, **head_kwargs) -> nn.Module:
    """Put a ``FactoredSphericalHead`` (with ``head_kwargs``, any of its arguments: ``loss``,
    ``lr``, ``negatives``...; its defaults are lst-train's head) in place of ``model.lm_head``,
    starting from its weight, and patch ``model.forward`` (docs/integrations.md). On a GPU its
    step is compiled and reads its checks every ``sync_every`` steps; it is not replayed from a
    CUDA graph, which steps in the forward: the Trainer steps the head at its optimizer's step.
    Returns the model, changed in place; an unsupported model raises one ValueError and is left
    unchanged."""
    linear = check_patchable(model)
    head = head_from_linear(linear, head_kwargs, "factor_lm_head")
    #: items_over_world: the Trainer's num_items_in_batch counts the world's tokens (its
    #: average_tokens_across_devices; head_follows_trainer sets it); whole_v: a sharded V
    #: gathered for the next checkpoint (processes.py)
    patch = types.SimpleNamespace(linear_dtype=linear.weight.dtype, body_dtype=body_dtype(model), items_over_world=True,
                                  whole_v=None)
    # Savers of HF models (save_pretrained, the Trainer's checkpoints: safetensors) take tensors only.
    head.register_state_dict_post_hook(functools.partial(_tensors_only, patch))
    head.register_load_state_dict_pre_hook(_without_extra_state)
    setattr(model, PATCH, patch)
    model.lm_head = head
    ddp_ignores_head(model, "lm_head", head)  # several processes: the head keeps its replicas itself
    model.forward = OwnForward(model)  # an instance attribute (export deletes it)
    model.resize_token_embeddings = functools.partial(_resize_refused, model)  # the same way
    model.save_pretrained = functools.partial(_save_pretrained, model)  # the same way
    return model


class OwnForward:
    """The patched model's forward, ``_forward`` with the model, an attribute of its own that pickles
    by reference (a bound method would pickle as the class's). accelerate's
    ``unwrap_model(model, keep_fp32_wrapper=False)`` gives a model the forward it wrapped for mixed
    precision bound to the model, as it would a class's function, so the call comes with the model
    first: that argument is dropped, and this forward takes its place back (bound, it cannot be
    pickled)."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:
        """``_forward``'s without the model, as ``inspect.signature`` reports a partial's: the HF Trainer
        keeps the dataset's columns the forward names."""
        return inspect.signature(functools.partial(_forward, self.model))

    @property
    def __name__(self) -> str:
        """What pickle asks of a bound forward, refused with the fix (an AttributeError, so that
        ``functools.wraps`` and others that ask with a default go on)."""
        raise AttributeError(f"{type(self.model).__name__}'s patched forward, bound to the model by accelerate's "
                             "unwrap_model(model, keep_fp32_wrapper=False), cannot be pickled: call the model once "
                             "first (the forward then takes its own place back), or save model.state_dict()")

    def __call__(self, *args, **kwargs):
        model = self.model
        if args and args[0] is model:
            args = args[1:]
            bound = vars(model).get("forward")
            if getattr(bound, "__func__", None) is self:
                vars(model)["forward"] = self
        return _forward(model, *args, **kwargs)


def _resize_refused(model: nn.Module, *args, **kwargs):
    """A patched model's ``resize_token_embeddings``: refused before anything changes
    (transformers' would resize the input embedding, then fail on the factored head)."""
    raise ValueError(f"{type(model).__name__} has the factored head, which resize_token_embeddings() cannot resize: "
                     "export_dense_head(model) first, resize, then factor_lm_head(model) again")


def lm_head_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the patched model's ordinary lm_head: the original lm_head's, or the model's
    own where it was cast since the patch (the lm_head would have been cast with it: its forward
    takes the body's hidden states)."""
    patch, now = getattr(model, PATCH), body_dtype(model)
    return patch.linear_dtype if now == getattr(patch, "body_dtype", now) else now


def dense_lm_head(model: nn.Module, state_dict: dict, prefix: str = "lm_head.") -> dict[str, Tensor]:
    """The ordinary lm_head's tensors, ``weight`` (and ``bias``: the bias column) of W = V U + 1 omega^T,
    from the head's factors in the patched model's ``state_dict`` (none without them, or with a shard of
    V), in ``lm_head_dtype``: what ``export_dense_head`` writes, bit for bit."""
    head, V = factored_head(model), state_dict.get(prefix + "V")
    if V is None or V.shape[0] != head.num_classes:  # no head in the state, or a shard of V not gathered for it
        return {}
    W = weight_of(V, state_dict[prefix + "U"], state_dict[prefix + "omega"], lm_head_dtype(model))
    out = {prefix + "weight": W[:, : head.hidden_dim].contiguous()}
    if head.bias:
        out[prefix + "bias"] = W[:, head.hidden_dim].contiguous()
    return out


def _save_pretrained(model: nn.Module, *args, **kwargs):
    """A patched model's ``save_pretrained`` (the Trainer's checkpoints and ``save_model()`` too):
    the head's factors, from which a patched model resumes bit for bit, and beside them the dense
    ``lm_head.weight`` (and ``lm_head.bias``, ``dense_lm_head``), so that ``from_pretrained`` of the
    model's own class loads the trained W (it lists the factors' keys as unexpected); a patched
    model loading the checkpoint leaves the dense tensors out."""
    call = inspect.signature(type(model).save_pretrained).bind(model, *args, **kwargs)  # state_dict however given
    given = call.arguments.get("state_dict")
    state = dict(model.state_dict() if given is None else given)
    dense = dense_lm_head(model, state)
    if not dense and "lm_head.V" in state:  # a sharded head's rows on this rank, its V not gathered
        warn(f"save_pretrained: this file holds this rank's rows of the sharded head's V only, and no dense "
             f"lm_head.weight, so {type(model).__name__}.from_pretrained would make a random lm_head: call "
             f"gather_head_for_checkpoint(model) on every rank before the save")
    state.update(dense)
    call.arguments["state_dict"] = state
    return type(model).save_pretrained(*call.args, **call.kwargs)


#: the key (after the head's prefix) of whether U^-1 is fresh, saved as a tensor
UINV_FRESH = "uinv_fresh"
#: the keys of the sampled classes' generator states (host, device), saved as tensors
NEGATIVES_RNG = {"rng": "negatives_rng", "device_rng": "negatives_device_rng"}


def _tensors_only(patch, head, state_dict, prefix, local_metadata) -> None:
    """The head's state in a patched model as tensors only: its extra state (lr, weight decay,
    the loss's name: settings the loop gives again) is left out; whether U^-1 is fresh, the
    one part of it the step reads, becomes a tensor, and so do the sampled classes' generator
    states, so a checkpoint resumes bit for bit. A sharded head's whole V (``whole_v_into``), or
    else the rows its shard holds, as a tensor."""
    state_dict.pop(prefix + "_extra_state", None)
    state_dict[prefix + UINV_FRESH] = torch.tensor(head.uinv_fresh)
    drawn = head.negatives.state() if head.negatives is not None else {}
    for part, key in NEGATIVES_RNG.items():
        if drawn.get(part) is not None:
            state_dict[prefix + key] = drawn[part]
    whole_v_into(patch, head, state_dict, prefix)
    if state_dict[prefix + "V"].shape[0] != head.num_classes:
        state_dict[prefix + V_ROWS] = torch.tensor([head.row_lo, head.row_hi])


def _without_extra_state(head, state_dict, prefix, *args) -> None:
    """Loads what ``_tensors_only`` saved: the head keeps its settings (lr, weight decay, loss)
    and takes whether U^-1 is fresh from the tensor; with neither (nothing known) U^-1 is
    taken as stale, refreshed exactly from U when next needed (O(d^3)); the sampled classes'
    generators take their saved states; the dense lm_head saved beside the factors is left out. (The
    rows of a shard of V the head reads itself.)"""
    if prefix + "V" in state_dict:  # the dense lm_head saved beside the factors (_save_pretrained): not the head's
        state_dict.pop(prefix + "weight", None)
        state_dict.pop(prefix + "bias", None)
    fresh = state_dict.pop(prefix + UINV_FRESH, None)
    rngs = {part: state_dict.pop(prefix + key) for part, key in NEGATIVES_RNG.items() if prefix + key in state_dict}
    if prefix + "_extra_state" not in state_dict:
        extra = {**head.get_extra_state(), "uinv_fresh": bool(fresh)}
        if head.negatives is not None and "rng" in rngs:
            extra["negatives"] = {"settings": head.negatives.settings.public(), **rngs}
        state_dict[prefix + "_extra_state"] = extra


def factored_head(model: nn.Module) -> FactoredSphericalHead:
    """The factored head of a model patched by ``factor_lm_head`` (``model.lm_head``) or
    ``factor_gpt_head`` (``model.factored_head``); ValueError otherwise."""
    head = getattr(model, "factored_head", getattr(model, "lm_head", None))
    if isinstance(getattr(head, "original_module", None), FactoredSphericalHead):  # PEFT's ModulesToSaveWrapper
        raise ValueError("lm_head is in the PEFT config's modules_to_save, which copies the factored head (its state "
                         "twice): leave it out; the head trains by its own step, and head_follows_trainer saves it "
                         "with each checkpoint")
    if getattr(model, PATCH, None) is None or not isinstance(head, FactoredSphericalHead):
        raise ValueError(f"{type(model).__name__} has no factored head: call factor_lm_head(model) "
                         "(transformers) or factor_gpt_head(model) (litgpt) first")
    return head


def gather_head_for_checkpoint(model: nn.Module) -> None:
    """Every rank, before a save that holds the patched model's state (``fabric.save``, your
    own loop's): a sharded head's V is gathered on rank 0's host, and rank 0's next state dict
    holds all of V while the head is unchanged, so the checkpoint resumes on any number of
    processes. Nothing to do for a replicated head or one process. (The HF Trainer's
    ``head_follows_trainer`` does it before each of its checkpoints.)"""
    getattr(model, PATCH).whole_v = gather_for_checkpoint(factored_head(model))


def check_training_has_labels(model: nn.Module, labels: Tensor | None, name: str, instead: str) -> None:
    """One ValueError, before the body runs, for a training forward (``model.train()``, grad
    enabled) without ``name`` (labels, targets): the head trains through its own loss, so its
    logits carry no gradient and a loss computed from them (the Trainer's ``compute_loss_func``)
    could not train it (the first backward would fail: "element 0 of tensors does not require
    grad"). ``instead``: the call that gives the loss. Changes nothing."""
    if labels is None and model.training and torch.is_grad_enabled():
        raise ValueError(f"a training forward (model.train(), grad enabled) of {type(model).__name__} with the factored "
                         f"head needs {name}: the head trains through its own loss, so its logits carry no gradient "
                         f"and a loss computed from them (the HF Trainer's compute_loss_func, a loss of your own) "
                         f"cannot train it; {instead}, or call it under torch.no_grad() or in eval mode for the logits")


def check_trainer_steps_the_head(model: nn.Module, head: FactoredSphericalHead, num_items_in_batch) -> None:
    """One ValueError, before the body runs, for a training forward that transformers' ``Trainer``
    (or a subclass: found on the call stack) makes while the head is attached to no optimizer:
    without ``head_follows_trainer()`` the head would step in every micro-batch's backward at its
    own lr, not once per optimizer step on the Trainer's schedule. The Trainer gives the patched
    forward ``num_items_in_batch`` (it takes loss kwargs): a forward without it is not the
    Trainer's, and a loop of one's own walks no stack. Changes nothing."""
    if num_items_in_batch is None or head.attached:
        return
    frame, depth = sys._getframe(1), 0
    while frame is not None and depth < 64:
        mro = type(frame.f_locals.get("self")).__mro__
        if any(c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in mro):
            raise ValueError(f"{type(model).__name__}'s factored lm_head is trained by transformers' Trainer without "
                             f"head_follows_trainer(): it would step at every micro-batch at its own lr, not once per "
                             f"optimizer step on the Trainer's schedule; pass Trainer(..., callbacks="
                             f"[head_follows_trainer()]) (from lst_lightning.integrations)")
        frame, depth = frame.f_back, depth + 1


def check_labels_shape(labels: Tensor | None, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> None:
    """One ValueError, before the body runs, for labels whose shape is not the input's (b, T):
    the model shifts them itself, and labels of another shape with as many elements after the
    shift (ids (2, 4), labels (3, 3)) would pair positions with the wrong labels."""
    given = input_ids.shape if input_ids is not None else None if inputs_embeds is None else inputs_embeds.shape[:-1]
    if labels is not None and given is not None and labels.shape != given:
        raise ValueError(f"labels must have the shape of the input {tuple(given)}, unshifted (the model shifts "
                         f"them: position t predicts labels[:, t + 1]), got {tuple(labels.shape)}")


def shifted(hidden: Tensor, labels: Tensor, head: FactoredSphericalHead | None = None) -> tuple[Tensor, Tensor]:
    """transformers' causal shift: hidden[:, t] predicts labels[:, t + 1]; rows (m, d), targets (m,).
    Sequences of one token leave no row: refused in one line saying so, for ``head`` on one process
    (several processes leave it to the head, which voids the step on every rank)."""
    if hidden.shape[1] < 2 and head is not None and head.processes.alone:
        raise ValueError(f"the batch's sequences have {hidden.shape[1]} token(s): the causal shift (position t "
                         "predicts the label at t + 1) leaves no position to predict; give sequences of 2 or more")
    return hidden[:, :-1].reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)


def head_loss(head: FactoredSphericalHead, hidden: Tensor, labels: Tensor,
              num_items_in_batch: int | Tensor | None = None, items_over_world: bool = True) -> Tensor:
    """The head's loss on the shifted labels: the mean over real (non -100) tokens, or with
    ``num_items_in_batch`` their sum divided by it (the Trainer's exact accumulation).
    Training on several processes, the head's loss is over the world's tokens and each rank
    returns its share (processes.py; ``items_over_world``: the count is the world's)."""
    H, y = shifted(hidden, labels.to(hidden.device), head)
    world = join_processes(head) if head.in_training_step else 1
    head.reduction = "mean_real" if num_items_in_batch is None else "sum"
    loss = head(H, y)
    if num_items_in_batch is not None:
        if world > 1:
            return world_share(loss, num_items_in_batch, world, items_over_world)
        loss = loss / torch.as_tensor(num_items_in_batch, dtype=loss.dtype, device=loss.device)
    return loss


@torch.no_grad()
def dense_outputs(head: FactoredSphericalHead, hidden: Tensor, chunk_size: int = 65536) -> Tensor:
    """The outputs o = W h (what the exported dense lm_head gives) for hidden (..., d),
    made in chunks of the vocabulary: (..., D) in the head's dtype. A head sharded over several
    processes: every rank calls it, each with its own rows (any number); every rank's rows are
    gathered, each rank scores them on its classes, and each takes its own rows' outputs for
    all D classes back."""
    H = hidden.reshape(-1, hidden.shape[-1])
    held = head.V.shape[0]  # a sharded head: its own classes row_lo:row_hi, then every rank's
    mine = None
    if held != head.num_classes:
        (H,), mine = head.processes.pg.gather_rows([H], [0.0])  # every rank's rows, then this rank's slice
    out = torch.empty(H.shape[0], held, dtype=head.dtype, device=head.device)
    with torch.autocast(head.device.type, enabled=False):  # in the head's dtype, whatever the caller's autocast
        Hx = head.augment(H)
        HU, Hw = Hx @ head.U.T, Hx @ head.omega
        for a in range(0, held, chunk_size):
            rows = head.V[a:a + chunk_size]
            torch.addmm(Hw[:, None], HU, rows.T, out=out[:, a:a + rows.shape[0]])
    if mine is not None:
        out = every_rank_classes(head, out)[mine]
    return out.reshape(*hidden.shape[:-1], head.num_classes)


def scored_by_outputs(head: FactoredSphericalHead) -> bool:
    """Whether a forward with labels is scored by the cross-entropy of softmax(o) over all D
    classes rather than by the head's loss: evaluation without grad (``Trainer.evaluate()``,
    ``torch.no_grad()``) of a loss whose outputs are logits (``loss="sampled"``, whose
    probability is softmax(o)). The head's own loss there would be its spherical terms alone
    (no draw), not a log-likelihood; the losses with a probability of their own (spherical,
    Taylor softmax) already give their -log p."""
    return head.loss_fn.outputs_are_logits and not torch.is_grad_enabled()


@torch.no_grad()
def outputs_nll(head: FactoredSphericalHead, H: Tensor, y: Tensor, outputs: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """The sum over the rows of H (m, d) with a real target ``y`` (m,) of -log softmax(o)[y],
    o = W h over all D classes (``dense_outputs``, or ``outputs`` (m, D) when made already),
    and the count of those rows: the exported model's cross-entropy, in the head's dtype. The
    targets are checked as the head checks them (padding: -1 or the head's ignore_index)."""
    idx, _, valid = target_slots(y, None, H.shape[0], head.num_classes, head.dtype, ignore_index=head.ignore_index)
    o = dense_outputs(head, H) if outputs is None else outputs
    return F.cross_entropy(o, idx[:, 0].to(o.device), ignore_index=-1, reduction="sum"), valid.sum()


def outputs_loss(head: FactoredSphericalHead, hidden: Tensor, labels: Tensor,
                 num_items_in_batch: int | Tensor | None = None, outputs: Tensor | None = None) -> Tensor:
    """``outputs_nll`` on the shifted labels, as transformers' own loss: the mean over real
    tokens, or with ``num_items_in_batch`` the sum divided by it. ``outputs``: o of every
    position of ``hidden`` (b, T, D), when made already."""
    H, y = shifted(hidden, labels.to(hidden.device), head)
    nll, real = outputs_nll(head, H, y, None if outputs is None else outputs[:, :-1].reshape(-1, head.num_classes))
    count = real.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return nll / torch.as_tensor(count, dtype=nll.dtype, device=nll.device)


def last_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """transformers' ``logits_to_keep``: every position for 0, the last n for an int n, the
    given positions for a tensor of indices."""
    if isinstance(logits_to_keep, Tensor):
        return hidden[:, logits_to_keep]
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
             labels=None, use_cache=None, logits_to_keep=0, num_items_in_batch=None, **kwargs):
    """The patched forward: the body, then the factored head's loss (labels given) and the
    outputs o as logits only where asked (no labels without grad, or eval mode)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    check_training_has_labels(self, labels, "labels", "pass labels= (the model shifts them) and use out.loss")
    check_labels_shape(labels, input_ids, inputs_embeds)
    if labels is not None and self.lm_head.in_training_step:
        check_not_fsdp1(self)  # your own FSDP1 loop (the Trainer's FSDP is refused when it is built)
        check_trainer_steps_the_head(self, self.lm_head, num_items_in_batch)
    out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden, head = out[0], self.lm_head
    outputs = None
    if labels is None or not self.training:
        outputs = dense_outputs(head, last_positions(hidden, logits_to_keep))
    if labels is None:
        loss = None
    elif scored_by_outputs(head):  # evaluation of loss="sampled": the cross-entropy of softmax(o)
        every = isinstance(logits_to_keep, int) and logits_to_keep == 0  # the outputs made above are all of them
        loss = outputs_loss(head, hidden, labels, num_items_in_batch, outputs if every else None)
    else:
        loss = head_loss(head, hidden, labels, num_items_in_batch, getattr(self, PATCH).items_over_world)
    logits = None if outputs is None else outputs.to(hidden.dtype)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=getattr(out, "past_key_values", None),
                                  hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))
