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


def test_every_head_takes_the_classes_and_the_width_by_position_as_by_keyword():
    """``Head(D, d)`` is ``Head(num_classes=D, hidden_dim=d)`` for every head, as for ``FactoredSphericalHead``."""
    from lst_lightning.baselines import AdaptiveSoftmaxHead, HierarchicalSoftmaxHead, SampledSoftmaxHead, SoftmaxHead
    from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

    for cls in (SoftmaxHead, HierarchicalSoftmaxHead, AdaptiveSoftmaxHead, SampledSoftmaxHead, FactoredSphericalHead,
                NaiveSphericalHead):
        extra = {"class_counts": zipf_counts(60)} if cls is HierarchicalSoftmaxHead else {}
        torch.manual_seed(0)
        by_position = cls(60, 16, **extra)
        torch.manual_seed(0)
        by_keyword = cls(num_classes=60, hidden_dim=16, **extra)
        a, b = by_position.state_dict(), by_keyword.state_dict()
        assert (by_position.num_classes, a.keys()) == (60, b.keys()), cls.__name__
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)), cls.__name__
