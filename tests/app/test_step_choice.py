"""``head.step=auto`` (the app's default for the factored head): a CUDA graph on one CUDA
device where nothing refuses it, else the autograd step; device flags either way. The run's
trainer is a stand-in here (no GPU in CI); the graph itself is tested on CUDA by
tests/spherical/test_cuda.py."""
import logging
from types import SimpleNamespace

import pytest
import torch

from lst_lightning.app.step_choice import choose_step, graph_refusal
from lst_lightning.spherical import FactoredSphericalHead
from lst_lightning.spherical.driving import SYNC_EVERY

from app_configs import FAST, cfg_of


def trainer(device="cuda", world_size=1, accumulate=1, scaler=None):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), world_size=world_size,
                           accumulate_grad_batches=accumulate, precision_plugin=SimpleNamespace(scaler=scaler))


def head(**kw):
    return FactoredSphericalHead(num_classes=50, hidden_dim=4, loss="sampled", **{"negatives": {"num": 8}, **kw})


def test_one_cuda_device_replays_the_step_from_a_graph(caplog):
    h = head()
    with caplog.at_level(logging.INFO, logger="lst_lightning.app.step_choice"):
        choose_step(h, trainer())
    assert (h.step, h.sync_every) == ("cuda_graph", SYNC_EVERY)
    # the head is built on the CPU and moved later: the log says what its step is on the training device
    assert f"compiled step replayed from a CUDA graph, its flags read every {SYNC_EVERY} steps" in caplog.text
    caplog.clear()
    h = head(compile_step=False)
    with caplog.at_level(logging.INFO, logger="lst_lightning.app.step_choice"):
        choose_step(h, trainer())
    assert "the head's eager step replayed from a CUDA graph" in caplog.text


def test_a_sync_every_given_above_one_is_kept():
    h = head(sync_every=8)
    choose_step(h, trainer())
    assert (h.step, h.sync_every) == ("cuda_graph", 8)


def test_one_cpu_process_takes_the_fused_step(caplog):
    """On the CPU without accumulation or a loss scaler the step runs in the forward
    (``train_step``'s), silently; anything that waits for the optimizer's step keeps autograd."""
    h = head()
    with caplog.at_level(logging.INFO, logger="lst_lightning.app.step_choice"):
        choose_step(h, trainer(device="cpu"))
    assert (h.step, h.sync_every) == ("fused", SYNC_EVERY)
    assert caplog.text == ""
    for run in (dict(world_size=2), dict(accumulate=4), dict(scaler=object())):
        h = head()
        choose_step(h, trainer(device="cpu", **run))
        assert h.step == "autograd", run


@pytest.mark.parametrize("run,why", [
    (dict(world_size=2), "2 processes exchange the head's data each step"),
    (dict(accumulate=4), "trainer.accumulate_grad_batches=4 steps at the optimizer's step"),
    (dict(scaler=object()), "a loss scaler (fp16) steps at the optimizer's step"),
])
def test_what_refuses_the_graph_leaves_the_autograd_step(run, why, caplog):
    assert graph_refusal(trainer(**run)) == why
    h = head()
    with caplog.at_level(logging.INFO, logger="lst_lightning.app.step_choice"):
        choose_step(h, trainer(**run))
    assert (h.step, h.sync_every) == ("autograd", SYNC_EVERY)
    # said where the run trains on a GPU, silent on the CPU
    assert (why in caplog.text) == (run.get("device", "cuda") == "cuda")


def test_the_heads_own_refusal_leaves_it_as_it_was(caplog):
    """Host checks (sync_every=1) cannot run inside a graph: the head refuses the graph, and keeps
    its settings."""
    h = head(sync_every=1)
    with caplog.at_level(logging.INFO, logger="lst_lightning.app.step_choice"):
        choose_step(h, trainer())
    assert (h.step, h.sync_every) == ("autograd", 1)
    assert "it needs sync_every > 1" in caplog.text


def test_the_app_defaults_to_auto_and_trains_on_one_cpu_fused(tmp_path):
    from lst_lightning.app.train import build, run  # noqa: PLC0415

    cfg = cfg_of(*FAST, "head=factored")
    assert cfg.head.step == "auto"
    _, module, _ = build(cfg, tmp_path)
    assert (module.head.step, module.head.sync_every) == ("fused", SYNC_EVERY)
    # results.json says which step ran
    assert run(cfg_of(*FAST, "head=factored", "test=false"), tmp_path / "run")["head_step"] == "fused"
    _, module, _ = build(cfg_of(*FAST, "head=factored", "head.step=fused"), tmp_path / "fused")
    assert module.head.step == "fused"
