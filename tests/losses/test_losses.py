"""Each loss's (q, s, a) form against the same loss written on the full output."""
import pytest
import torch

from lst_lightning.losses import LOSSES, make_loss

from loss_cases import KWARGS, random_batch

@pytest.mark.parametrize("name", sorted(LOSSES))
def test_factored_form_equals_dense_form(name):
    loss = make_loss(name, **KWARGS.get(name, {}))
    O, idx, T = random_batch()
    D = O.shape[1]
    Y = torch.zeros_like(O).scatter_add_(1, idx.clamp(min=0), T)
    A = torch.where(idx >= 0, O.gather(1, idx.clamp(min=0)), torch.zeros((), dtype=O.dtype))
    y_sq = (Y * Y).sum(1)
    got = loss((O * O).sum(1), O.sum(1), A, T, num_classes=D, y_sq=y_sq)
    want = loss.dense(O, Y)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["spherical_softmax", "taylor_softmax"])
def test_normalised_log_prob(name):
    loss = make_loss(name)
    O, idx, _ = random_batch()
    dense = loss.dense_log_prob(O)
    torch.testing.assert_close(dense.exp().sum(1), torch.ones(O.shape[0], dtype=O.dtype))
    A = O.gather(1, idx.clamp(min=0))
    got = loss.log_prob((O * O).sum(1), O.sum(1), A, num_classes=O.shape[1])
    torch.testing.assert_close(got, dense.gather(1, idx.clamp(min=0)))


def test_unnormalised_losses_refuse_log_prob():
    with pytest.raises(NotImplementedError, match="zloss"):
        make_loss("zloss").log_prob(None, None, None, num_classes=3)


def test_bad_names_and_hyperparameters():
    with pytest.raises(ValueError, match="unknown spherical loss"):
        make_loss("softmax")
    with pytest.raises(ValueError, match="a > 0"):
        make_loss("zloss", a=0.0)
    with pytest.raises(ValueError, match="eps > 0"):
        make_loss("spherical_softmax", eps=-1)
    with pytest.raises(TypeError, match="zloss"):
        make_loss("zloss", c=1.0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_score_orders_classes_as_the_loss_does(name):
    O = torch.randn(6, 50, dtype=torch.float64) * 3  # many outputs below -1
    loss = make_loss(name, **KWARGS.get(name, {}))
    sc = loss.score(O)
    if loss.normalised:  # the score is increasing in p: same order as log p
        lp = loss.dense_log_prob(O)
        assert torch.equal(sc.argsort(1), lp.argsort(1))
        assert not torch.equal(O.argmax(1), lp.argmax(1))  # ranking by o would be wrong here
    else:  # Z-loss and squared error: larger o, smaller loss for a target class
        assert torch.equal(sc, O)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_config_defaults_are_the_losss_own(name):
    """The app's loss config is the loss's own defaults: conf/loss/<name>.yaml restates none
    (its schema is the constructor's signature, app/schemas.py) and sets no lr (a head built
    without one, as the app builds it, takes the loss's default_lr), so both routes train alike."""
    import inspect  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from hydra import compose, initialize_config_dir  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415

    from lst_lightning.app.configs import config_dir  # noqa: PLC0415

    own = set(OmegaConf.load(Path(config_dir()) / "loss" / f"{name}.yaml"))
    assert own == {"defaults"}  # loss=sampled's negatives: the spherical heads' own (conf/head/negatives)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[f"loss={name}"]).loss
    loss = make_loss(name)
    params = inspect.signature(type(loss)).parameters
    own = {k: p.default for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert cfg.name == name and dict(cfg.kwargs) == own


def test_the_head_lr_follows_the_losss_rule_in_d():
    """A head built without an lr, S or mu takes its loss's for its D: the composite loss's are
    lr 2, S 64, mu 1 below 10^5 classes (the real corpus at its own D) and lr 16, S 512, mu 0.1
    from there, S 1024 from 10^7; the others' lr is one number at every D."""
    from lst_lightning.losses import SampledCompositeLoss  # noqa: PLC0415
    from lst_lightning.spherical import FactoredSphericalHead  # noqa: PLC0415

    assert [SampledCompositeLoss.default_lr_for(D) for D in (10_000, 33_155, 99_999, 100_000, 999_999, 10**6)] == \
        [2.0, 2.0, 2.0, 16.0, 16.0, 16.0]
    assert {make_loss("zloss").default_lr_for(D) for D in (10, 10**7)} == {1.0}
    for D, lr, S, mu in ((1000, 2.0, 64, 1.0), (99_999, 2.0, 64, 1.0), (200_000, 16.0, 512, 0.1),
                         (10**6, 16.0, 512, 0.1), (10**7, 16.0, 1024, 0.1)):
        head = FactoredSphericalHead(num_classes=D, hidden_dim=4, loss="sampled", negatives={}, device="meta")
        assert (head.lr, head.negatives.settings.num, head.loss_fn.mu) == (lr, S, mu)
        assert head.loss_fn.hparams()["mu"] == mu  # what a checkpoint records and compares
    given = FactoredSphericalHead(num_classes=10**6, hidden_dim=4, loss="sampled", negatives={"num": 8},
                                  loss_kwargs={"mu": 1.0}, device="meta")
    assert (given.negatives.settings.num, given.loss_fn.mu) == (8, 1.0)
    assert make_loss("sampled").mu == 1.0  # alone, without a head's D
    assert FactoredSphericalHead(num_classes=1000, hidden_dim=4, loss="sampled", negatives={}, lr=0.5,
                                 device="meta").lr == 0.5
