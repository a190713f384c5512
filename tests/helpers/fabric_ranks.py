"""litgpt's GPT with the factored head (factor_gpt_head) trained by a Fabric loop of litgpt's
shape on one process or two gloo processes (as torchrun starts them): under Fabric's DDP, and
with the body sharded by FSDP2 (Fabric's ModelParallelStrategy, litgpt's blocks each a unit)
and the head out of it; and wrapped by FSDP1 (refused). Used by tests/integrations/test_litgpt_processes.py."""
import os

import lightning as L
import torch

VOCAB, PADDED, HIDDEN, T = 40, 48, 16, 12
WORLD, B, STEPS = 2, 2, 3


def tiny_gpt():
    from litgpt import GPT, Config

    torch.manual_seed(0)
    return GPT(Config(name="tiny", block_size=32, vocab_size=VOCAB, padded_vocab_size=PADDED, n_layer=2, n_head=2,
                      n_embd=HIDDEN, rotary_percentage=1.0, parallel_residual=False, bias=False,
                      norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=32))


def batches(world_batch: int, accumulate: int, steps: int = STEPS):
    """litgpt's (input_ids, targets) for every micro-batch of every step, -100 on some rows' ends
    (the first steps' the same whatever ``steps``)."""
    g = torch.Generator().manual_seed(3)
    n = world_batch * accumulate * steps
    data = torch.randint(0, VOCAB // 4, (n, T + 1), generator=g)
    ids, targets = data[:, :-1], data[:, 1:].clone()
    targets[::3, -4:] = -100  # the ranks hold different numbers of real targets
    return ids.split(world_batch), targets.split(world_batch)


def shard_blocks(model, device_mesh):
    """Fabric's ModelParallelStrategy parallelize_fn: each litgpt block an FSDP2 unit, then the
    model (the embedding, the last norm; the factored head has no parameters)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model


def whole_w(head):
    """The head's W, all D rows (a sharded head's gathered: every rank calls it)."""
    from lst_lightning.integrations.processes import every_rank_classes

    W = head.weight()
    return W if W.shape[0] == head.num_classes else every_rank_classes(head, W.T).T


def train(strategy: str, parallel: str, accumulate: int = 1, batch: int = B, patch_first: bool = False,
          steps: tuple[int, int] = (0, STEPS), load=None, save=None, gather: bool = True):
    """Optimizer steps ``steps[0]`` to ``steps[1]`` of ``accumulate`` micro-batches of ``batch``
    rows per process (``strategy``: "ddp", float64; "fsdp2", float32, several processes, one-file
    checkpoints; "float32", one process), from Fabric's checkpoint ``load`` if given, then saved
    to ``save`` (after ``gather_head_for_checkpoint`` unless not ``gather``); returns the body's
    whole parameters, the head's W (whole) and the losses, or the ValueError of the load."""
    from lst_lightning.integrations import factor_gpt_head, factored_head, gather_head_for_checkpoint

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        fabric = L.Fabric(accelerator="cpu", devices=world, precision="32-true",
                          strategy=ModelParallelStrategy(shard_blocks, data_parallel_size=world, tensor_parallel_size=1,
                                                         save_distributed_checkpoint=False))
    else:  # "ddp" (one process: "auto") in float64; "float32": one process, the FSDP2 runs' reference
        fabric = L.Fabric(accelerator="cpu", devices=world, precision="64-true" if strategy == "ddp" else "32-true",
                          strategy="ddp" if world > 1 else "auto")
    if patch_first:  # the head is made alone (no process group yet) and joins the world at its first forward
        model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5, dtype=torch.float64, parallel=parallel)
    fabric.launch()
    dtype = torch.float64 if strategy == "ddp" else torch.float32
    if not patch_first:
        with fabric.init_module():
            model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5, dtype=torch.float64, parallel=parallel)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    head = factored_head(getattr(model, "module", model))
    W_initial = whole_w(head)
    if load is not None:
        V = head.V.clone()
        try:
            fabric.load(load, {"model": model, "optimizer": optimizer})
        except ValueError as e:
            return {"error": str(e), "V_unchanged": torch.equal(head.V, V), "steps": int(head.steps)}
    head.attach(optimizer)
    ids, targets = batches(batch * world, accumulate, steps[1])
    rank, losses = fabric.global_rank, []
    rows = slice(rank * batch, (rank + 1) * batch)
    for s in range(*steps):
        for k in range(accumulate):
            i = s * accumulate + k
            with fabric.no_backward_sync(model, enabled=k < accumulate - 1):
                loss = model(ids[i][rows], targets=targets[i][rows])
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    head.detach()
    if save is not None:
        if gather:
            gather_head_for_checkpoint(getattr(model, "module", model))
        fabric.save(save, {"model": model, "optimizer": optimizer})
    body = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(dtype).clone()
            for n, p in getattr(model, "module", model).named_parameters()}
    W = whole_w(head)
    return {"body": body, "W": W, "W_initial": W_initial, "losses": losses, "steps": int(head.steps),
            "dtensor": sorted(n for n, p in getattr(model, "module", model).named_parameters()
                              if type(p).__name__ == "DTensor")}


def under_fsdp1(use_orig_params: bool) -> dict:
    """A patched GPT wrapped as Fabric's FSDPStrategy wraps it (FSDP1, litgpt's blocks each a unit,
    the precision's mixed-precision config; device_id cpu: Fabric itself runs FSDP1 on GPUs only),
    then one training forward: its error, and whether the head stayed as it was."""
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
    from litgpt.model import Block
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lst_lightning.integrations import factor_gpt_head

    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5, parallel="replicated")
    head = model.factored_head
    V = head.V.clone()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                                       mixed_precision=FSDPPrecision("32-true").mixed_precision_config,
                                       use_orig_params=use_orig_params)
    ids, targets = batches(B, 1)
    try:
        wrapped(ids[0][:B], targets=targets[0][:B]).backward()
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "steps": int(head.steps), "V_unchanged": torch.equal(head.V, V)}


def worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    res = {"ddp_sharded": train("ddp", "sharded", patch_first=True),  # first: before any process group
           "ddp_replicated": train("ddp", "replicated", accumulate=2),
           "fsdp2_sharded": train("fsdp2", "sharded", accumulate=2),
           # checkpoints after 3 of 6 steps: V gathered (resumed here, and in one process by the test), or not
           **{f"{s}_saved": train(s, "sharded", save=out / f"{s}.ckpt") for s in ("ddp", "fsdp2")},
           "ddp_unsaved_shard": train("ddp", "sharded", save=out / "shard.ckpt", gather=False),
           **{f"{s}_resumed": train(s, "sharded", steps=(STEPS, 2 * STEPS), load=out / f"{s}.ckpt")
              for s in ("ddp", "fsdp2")},
           **{f"{s}_whole": train(s, "sharded", steps=(0, 2 * STEPS)) for s in ("ddp", "fsdp2")},
           "ddp_shard_elsewhere": train("ddp", "sharded", steps=(STEPS, 2 * STEPS), load=out / "shard.ckpt"),
           **{f"fsdp1_orig_params_{o}": under_fsdp1(o) for o in (False, True)}}
    res["out"] = out  # where the checkpoints are, for one process to resume from
    torch.save(res, out / f"rank{rank}.pt")
