"""A patched model trained by several processes: DDP under the Hugging Face Trainer
(``torchrun``, ``accelerate launch``: gloo on CPU, NCCL on GPU) or any DDP loop.

What each rank holds (docs/integrations.md): the body, replicated by DDP; the factored
head in its own multi-process mode, ``factor_lm_head(model, parallel="replicated")``
(the whole head) or ``"sharded"`` (V's rows of its D / P classes; the rest replicated),
which gathers the world's rows in each training forward and applies one global step
(spherical/multi_process.py). Three things make that fit DDP and the Trainer:

- DDP leaves the head's buffers alone: they are listed in the model's
  ``_ddp_params_and_buffers_to_ignore`` (``ddp_ignores_head``), which DDP reads when it
  wraps the model; otherwise it would copy rank 0's V over every rank at every forward
  (D x d numbers, and wrong for a sharded V).
- The loss each rank returns is its share of the world's loss (``world_share``): the head's
  loss is the world's already, and its dL/dH for a rank's rows is scaled by the world size
  so that DDP's average of the body's gradients is the world loss's gradient. With the
  Trainer's ``num_items_in_batch`` counted over the world (``average_tokens_across_devices``,
  its default) the Trainer multiplies each rank's loss by the world size: the share is then
  the world's loss / P. Counted per process, the counts are summed over the ranks.
- A head with ``parallel="none"`` under several processes is refused (each rank would
  train its own head on its own rows), with the fix.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..spherical import FactoredSphericalHead


def world_size() -> int:
    """The processes of the default torch.distributed group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_processes(head: FactoredSphericalHead, world: int) -> None:
    """One ValueError when ``world`` processes would train a head that has no multi-process mode."""
    if world > 1 and head.parallel == "none":
        raise ValueError(f"the factored head has parallel='none' but {world} processes train it: each would train "
                         "its own head on its own rows; patch with factor_lm_head(model, parallel='replicated') "
                         "(every rank holds the whole head) or parallel='sharded' (each rank holds V's rows of "
                         "D / P classes)")


#: accelerate's distributed types (``DistributedType``) that shard or replace the model's
#: modules, each with why the factored head cannot run under it
SHARDING_STRATEGIES = {
    "FSDP": "accelerate's FSDP wraps the whole model, head included: FSDP1 casts every buffer of the module it "
            "wraps to its mixed-precision dtype (the head's V, U and U^-1), and FSDP2 with the head in its unit is "
            "untested (accelerate runs FSDP on GPUs only)",
    "DEEPSPEED": "DeepSpeed's engine owns the backward and the optimizer step and partitions the model's state, "
                 "while the head steps itself at the optimizer's step",
    "MEGATRON_LM": "Megatron-LM replaces the model's layers with its own parallel layers",
}


def check_strategy(distributed_type) -> None:
    """One ValueError, before any step, when the Trainer (accelerate) runs a strategy the
    head cannot take part in: the reason and the supported alternative."""
    name = getattr(distributed_type, "name", str(distributed_type))
    if name in SHARDING_STRATEGIES:
        raise ValueError(f"the factored head cannot train under {name}: {SHARDING_STRATEGIES[name]}; train with DDP "
                         "(torchrun / accelerate launch --multi_gpu) and factor_lm_head(model, parallel='sharded') "
                         "when the head is what does not fit on one device")


#: why the head cannot train inside a module that FSDP1 wraps
FSDP1 = ("FSDP1 (torch's FullyShardedDataParallel: Fabric's FSDPStrategy, litgpt's --strategy fsdp) casts every "
         "buffer of the module it wraps to its mixed-precision dtype at each forward (the head's V, U and U^-1: "
         "bf16 under bf16-mixed)")


def check_not_fsdp1(model: nn.Module) -> None:
    """One ValueError, before the head's step, when FSDP1 manages ``model``'s parameters (it
    marks each one it flattens ``_fsdp_flattened``, with ``use_orig_params`` or not): the
    reason and the alternative. FSDP2 (``fully_shard``) and DDP pass. The parameters are
    scanned until a training forward passes (FSDP1 wraps a model before it trains), not at
    every step."""
    if getattr(model, "_lst_not_fsdp1", False):
        return
    if any(getattr(p, "_fsdp_flattened", False) for p in model.parameters()):
        raise ValueError(f"the factored head cannot train under {FSDP1}; shard the body with FSDP2 instead "
                         "(Fabric's ModelParallelStrategy with fully_shard on the blocks, the head out of it; "
                         "docs/integrations.md) or train under DDP")
    model._lst_not_fsdp1 = True


def join_processes(head: FactoredSphericalHead) -> int:
    """The head joins the default process group if it has not (every rank, at the same point:
    ``distribute`` is a collective); returns the world size. Refuses ``parallel='none'``."""
    world = world_size()
    check_processes(head, world)
    if world > 1 and head.processes.world != world:
        head.distribute()
    return world


def _ignored_elsewhere(model: nn.Module, prefix: str) -> list[str]:
    """The names DDP leaves alone that are not under ``prefix``."""
    return [n for n in getattr(model, "_ddp_params_and_buffers_to_ignore", ()) if not n.startswith(prefix + ".")]


def ddp_ignores_head(model: nn.Module, prefix: str, head: nn.Module) -> None:
    """List the head's buffers (names under ``prefix``) in what DDP leaves alone, keeping any
    names already listed; the head keeps its replicas or shards consistent itself."""
    names = [f"{prefix}.{n}" for n, _ in head.named_buffers()]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, _ignored_elsewhere(model, prefix) + names)


def ddp_forgets_head(model: nn.Module, prefix: str) -> None:
    """Undo ``ddp_ignores_head`` (``export_dense_head``: lm_head is an ordinary layer again)."""
    kept = _ignored_elsewhere(model, prefix)
    if kept:
        model._ddp_params_and_buffers_to_ignore = kept
    elif hasattr(model, "_ddp_params_and_buffers_to_ignore"):
        del model._ddp_params_and_buffers_to_ignore


def world_share(total: Tensor, num_items_in_batch: int | Tensor, world: int, items_over_world: bool) -> Tensor:
    """A rank's share of a training step's loss from ``total``, the head's sum over the world's
    real tokens: with ``num_items_in_batch`` counted over the world (the Trainer then
    multiplies the share by ``world``) total / items / world; counted per process, total over
    the sum of every rank's count."""
    items = torch.as_tensor(num_items_in_batch, dtype=total.dtype, device=total.device)
    if items_over_world:
        return total / (items * world)
    items = items.clone()
    dist.all_reduce(items)
    return total / items


def every_rank_classes(head: FactoredSphericalHead, own: Tensor) -> Tensor:
    """A sharded head's columns for all D classes from each rank's ``own`` columns (its
    classes row_lo:row_hi), all-gathered along the classes: every rank calls it."""
    pg = head.processes.pg
    widths = [hi - lo for lo, hi in (head.processes.shard_rows(r, pg.world) for r in range(pg.world))]
    padded = own.new_zeros(own.shape[0], max(widths))
    padded[:, : own.shape[1]] = own
    parts = [torch.empty_like(padded) for _ in range(pg.world)]
    dist.all_gather(parts, padded, group=pg.group)
    return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)


def whole_v_into(patch, head: FactoredSphericalHead, state_dict: dict, prefix: str, local_metadata=None) -> None:
    """A state-dict post hook (or its part): a sharded head's whole V, gathered for this save
    (``patch.whole_v``, with the head's version then), replaces its shard while the head has
    not changed since."""
    if patch.whole_v is not None and patch.whole_v[0] == head._version:  # gathered from this very state
        state_dict[prefix + "V"] = patch.whole_v[1]


def gather_for_checkpoint(head: FactoredSphericalHead) -> tuple[int, Tensor] | None:
    """A sharded head's whole V on rank 0 (on the host), with the head's version then (a state
    dict takes it only while the head is unchanged); None on the other ranks and when V is
    whole. Every rank calls it before a save that only rank 0 writes."""
    if not head.sharded or head.processes.world == 1:
        return None
    V = head.gather_v(dst=0)
    return None if V is None else (head._version, V)
