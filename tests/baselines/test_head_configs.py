"""conf/head/<baseline>.yaml: each builds a head the way the app does, and it trains."""
import pytest
import torch

from baseline_cases import zipf_counts


@pytest.mark.parametrize("name", ["softmax", "hsoftmax", "adaptive", "sampled", "sampled_unigram", "sampled_rff",
                                  "sampled_quadratic", "sampled_preconditioned"])
def test_head_configs_instantiate_and_train(name):
    """conf/head/<name>.yaml builds a head the way the app does, and one step runs."""
    import inspect

    import hydra
    from hydra import compose, initialize_config_dir

    from lst_lightning.app.configs import config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        cfg = compose("config", overrides=[f"head={name}"]).head  # the file also sets optimizer.head_lr
    assert "lr" not in cfg
    target = hydra.utils.get_class(cfg._target_)
    extra = {"class_counts": zipf_counts(60)} if "class_counts" in inspect.signature(target).parameters else {}
    head = hydra.utils.instantiate(cfg, num_classes=60, hidden_dim=16, _convert_="all", **extra)  # as app/train.py
    h = torch.randn(4, 16, requires_grad=True)
    loss = head(h, torch.randint(0, 60, (4,)))
    loss.backward()
    assert torch.isfinite(loss) and h.grad.abs().sum() > 0
