"""A patched HF model on two processes in an accelerate loop of your own (torchrun's ranks, gloo):
the head replicated or sharded, attached to the optimizer ``accelerator.prepare`` returns, with
gradient accumulation, trains the model one process trains on the union of the ranks' rows."""
import os

import pytest
import torch
from forked_ranks import fork_ranks

from lst_lightning.integrations import export_dense_head, factor_lm_head

from .conftest import VOCAB, tiny

MODES = ["replicated", "sharded"]
WORLD_ROWS, MICRO, STEPS = 4, 2, 3  # rows a micro-batch over the world, micro-batches a step, steps


def accelerate_run(parallel: str = "none", rank: int = 0, world: int = 1) -> dict:
    """The accelerate loop on ``rank`` of ``world``: each micro-batch's rows split over the ranks.
    Returns the exported W and the body's state, float64."""
    from accelerate import Accelerator  # noqa: PLC0415
    from accelerate.state import AcceleratorState, GradientState  # noqa: PLC0415

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, dtype=torch.float64, parallel=parallel).double()
    accelerator = Accelerator(gradient_accumulation_steps=MICRO, cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.unwrap_model(model).lm_head.attach(optimizer)
    ids = torch.randint(0, VOCAB, (WORLD_ROWS * MICRO * STEPS, 10), generator=torch.Generator().manual_seed(2))
    for micro in ids.split(WORLD_ROWS):
        rows = micro.chunk(world)[rank]  # no padding: every row's tokens count alike
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=rows, labels=rows).loss)
            optimizer.step()
            optimizer.zero_grad()
    plain = accelerator.unwrap_model(model)
    steps = int(plain.lm_head.steps)
    export_dense_head(plain)  # every rank: the whole W
    return {"steps": steps, "state": {k: v.detach().clone() for k, v in plain.state_dict().items()}}


def _rank(rank, port, out, parallel):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.save(accelerate_run(parallel, rank, 2), out / f"rank{rank}.pt")


def _replicated_rank(rank, port, out):
    _rank(rank, port, out, "replicated")


def _sharded_rank(rank, port, out):
    _rank(rank, port, out, "sharded")


@pytest.mark.parametrize("parallel", [pytest.param(p, marks=pytest.mark.slow if p == "sharded" else ())
                                      for p in MODES])  # sharded: -m slow (the head's: test_multi_process.py)
def test_an_accelerate_loop_on_two_processes_trains_as_one_process_on_the_union(tmp_path, parallel):
    ranks = fork_ranks({"replicated": _replicated_rank, "sharded": _sharded_rank}[parallel], tmp_path)
    one = accelerate_run()
    for got in ranks:
        assert got["steps"] == one["steps"] == STEPS  # one head step a window
        assert got["state"].keys() == one["state"].keys()
        for k, v in one["state"].items():
            assert torch.allclose(got["state"][k], v, rtol=1e-9, atol=1e-12), k
