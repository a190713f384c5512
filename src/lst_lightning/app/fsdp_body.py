"""The body sharded by FSDP2 (``trainer.strategy=fsdp2``), the head out of it.

Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism; it runs on CPU with
gloo and on GPUs with NCCL) sets up the processes and the device mesh and leaves the
sharding to the module (``LanguageModel.configure_model`` calls ``shard_body``). Here each
member of the body's module lists (a transformer's blocks) becomes an FSDP2 unit
(``torch.distributed.fsdp.fully_shard``) over the data-parallel mesh, then the body itself
(the rest of its parameters): each rank holds 1 / P of the body's parameters, gathered for
the forward and backward, and gradients are reduce-scattered (averaged), as DDP averages.

Kept out of FSDP:

- a self-updating head (the factored head): it has no parameters and steps itself in
  backward; it runs its own multi-process mode (``head.parallel``: replicated or sharded,
  docs/multi_gpu.md), exactly as under DDP. An ordinary head (softmax...) is sharded with
  the body.
- row-sparse parameters (the sparse input embedding, a ``head.sparse`` head's rows): FSDP2's
  sharded parameters take no sparse gradients. They stay whole on every rank
  (``ignored_params``) and the ``SparseGradients`` callback averages their gradients with
  all-gathers, as under DDP.

Tensor parallelism (``tensor_parallel_size > 1``) is refused: the bodies are not written for it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .optimizers import sparse_embedding_params

EXTRA_STATE = "_extra_state"  # torch's key of a module's get_extra_state() in its state dict

#: the value of ``trainer.strategy`` that selects this (Lightning has no string for it)
NAME = "fsdp2"


def fsdp2_strategy():
    """Lightning's ``ModelParallelStrategy`` with every process in one data-parallel group (the
    world, whatever ``devices`` and ``num_nodes`` say: -1 or "auto" too) and
    checkpoints as one file (the full state gathered on rank 0), as the app's checkpoints are;
    the optimizer of a body with row-sparse parameters (``PairedOptimizer``: a dense and a
    row-sparse optimiser) is saved part by part, each in torch's own format, as one process
    saves it: the checkpoint resumes under DDP, in one process or under fsdp2 on any number of
    processes, and theirs under fsdp2."""
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from .optimizers import PairedOptimizer

    class FSDP2Strategy(ModelParallelStrategy):
        def _setup_distributed(self) -> None:
            super()._setup_distributed()
            self._data_parallel_size = self.world_size  # the device mesh is made from it next

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            paired = [o for o in self.optimizers if isinstance(o, PairedOptimizer)]
            kept = self.optimizers
            if paired:  # Lightning loads the model; the parts are loaded below
                self.optimizers = []
            try:
                out = super().load_checkpoint(checkpoint_path, weights_only)
            finally:
                self.optimizers = kept
            path = Path(self.broadcast(checkpoint_path))
            if path.is_file():  # a full checkpoint (the app's): what Lightning's loading leaves out
                saved = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
                set_extra_states(self.lightning_module, saved["state_dict"])
                for i, opt in enumerate(self.optimizers):
                    if isinstance(opt, PairedOptimizer):
                        load_parts(self.model, opt, saved["optimizer_states"][i])
            return out

        def optimizer_state(self, optimizer):
            inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if isinstance(inner, PairedOptimizer):  # each part in torch's own format, as one process saves it
                return {"parts": [own_positions(self.model, o, super(FSDP2Strategy, self).optimizer_state(o))
                                  if holds_shards(o) else o.state_dict() for o in inner.parts]}
            return super().optimizer_state(optimizer)

    return FSDP2Strategy(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False)


def holds_shards(optimizer) -> bool:
    """Whether an optimiser steps FSDP2 shards (DTensor parameters)."""
    return any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


def _model_ids(model: nn.Module, optimizer) -> list[int]:
    """For each parameter of ``optimizer`` in its own order (its groups', as torch numbers a
    state dict), its index in ``model.parameters()`` (as FSDP's PARAM_ID keys number it)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [index[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _renumbered(state: dict, keys: dict) -> dict:
    """An optimiser state dict with its integer parameter keys mapped by ``keys``."""
    return {"state": {keys[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [keys[k] for k in g["params"]]} for g in state["param_groups"]]}


def own_positions(model: nn.Module, optimizer, state: dict) -> dict:
    """The full state of an optimiser of FSDP2 shards as Lightning's ModelParallelStrategy gives
    it on rank 0 (keyed by the index in ``model.parameters()``), keyed instead by the position
    in the optimiser's own groups: torch's format, what the part saves in one process, so the
    checkpoint resumes under any strategy and number of processes. Other ranks' (empty or
    keyed by name; not saved) are returned as they are."""
    groups = state.get("param_groups")
    if not groups or not all(isinstance(k, int) for g in groups for k in g["params"]):
        return state
    return _renumbered(state, {m: pos for pos, m in enumerate(_model_ids(model, optimizer))})


def load_parts(model: nn.Module, optimizer, state: dict) -> None:
    """A ``PairedOptimizer``'s parts from their states saved part by part, each in torch's own
    format (keyed by the position in the part's groups, as one process or DDP saves them):
    the dense part's full state loaded into its FSDP2 shards as Lightning loads one optimizer
    under ModelParallelStrategy, a row-sparse part's by its own ``load_state_dict`` (torch's
    loader would initialise its state with a dense zero gradient, which SparseAdam refuses).
    Checkpoints saved by this strategy before it saved torch's format (the row-sparse parts
    under ``"whole"``, the dense part keyed by the index in ``model.parameters()``) load too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    parts = state.get("parts") if isinstance(state, dict) else None
    if not isinstance(parts, list) or len(parts) != len(optimizer.parts):
        raise ValueError(f"the checkpoint's optimiser state has {len(parts or ())} parts, this run's "
                         f"{len(optimizer.parts)}: resume with the same model.sparse_embedding and optimizer settings")
    model_keyed = any("whole" in saved for saved in parts)  # the earlier format
    options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True)
    for part, saved in zip(optimizer.parts, parts):
        if not holds_shards(part):  # a row-sparse part (its parameters whole on every rank): torch's own format
            part.load_state_dict(saved.get("whole", saved))
            continue
        if not saved["state"]:  # no tensors (plain SGD): only the groups' settings, which torch's loader needs tensors for
            for group, saved_group in zip(part.param_groups, saved["param_groups"]):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
            continue
        if isinstance(next(iter(saved["state"])), int):
            if not model_keyed:
                saved = _renumbered(saved, dict(enumerate(_model_ids(model, part))))
            saved = FullyShardedDataParallel.rekey_optim_state_dict(saved, OptimStateKeyType.PARAM_NAME, model)
        set_optimizer_state_dict(model, part, optim_state_dict=saved, options=options)
    optimizer.param_groups = [g for o in optimizer.parts for g in o.param_groups]  # as its load_state_dict does


def set_extra_states(module: nn.Module, state_dict: dict) -> None:
    """Each submodule's ``_extra_state`` from a full state dict (Lightning's ModelParallelStrategy
    loads parameters and buffers one at a time, and no extra state)."""
    for name, sub in module.named_modules():
        key = f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE
        if key in state_dict:
            sub.set_extra_state(state_dict[key])


def check_fsdp2(strategy) -> None:
    """One ValueError when the strategy asks for more than FSDP2 data parallelism."""
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"tensor_parallel_size={tp}: the app's bodies are not written for tensor parallelism; "
                         f"use trainer.strategy={NAME} (FSDP2 data parallelism) or ddp")


def units(part: nn.Module, kept_out: set[int]) -> list[nn.Module]:
    """The modules under ``part`` that become FSDP units of their own: the members of its
    ``nn.ModuleList`` / ``nn.ModuleDict`` containers (a transformer's blocks), each called by
    the part's forward, which is when FSDP gathers a unit's parameters. Everything else is in
    the part's own unit, gathered for the part's forward (a module whose weight the forward
    reads directly, such as a position embedding, must not be a unit of its own)."""
    out = []
    for child in part.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += [m for m in child.children() if any(id(p) not in kept_out for p in m.parameters())]
    return out


def shard_body(module: nn.Module, mesh) -> None:
    """``fully_shard`` the body (and an ordinary head) over ``mesh``: the members of its module
    lists each a unit, then the part itself; row-sparse parameters and a self-updating head
    stay out (module docstring)."""
    from torch.distributed.fsdp import fully_shard

    sparse = set(sparse_embedding_params(module))
    kept_out = {id(p) for p in sparse}
    parts = [module.body] + ([] if module.head.self_updating else [module.head])
    for part in parts:
        for child in units(part, kept_out):
            fully_shard(child, mesh=mesh, ignored_params={p for p in child.parameters() if id(p) in kept_out} or None)
        if any(id(p) not in kept_out for p in part.parameters()):
            fully_shard(part, mesh=mesh, ignored_params={p for p in part.parameters() if id(p) in kept_out} or None)


def whole(t: Tensor) -> Tensor:
    """A parameter's whole value: an FSDP2 shard (DTensor) gathered (every rank calls it), else itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
