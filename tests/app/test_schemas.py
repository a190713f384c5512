"""app/schemas.py: the heads' and losses' settings are the code's signatures, the configs
restate none of their defaults, and every setting is a key (no ``+``) that refuses a typo."""
import dataclasses
import inspect

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lst_lightning.app.schemas import HEADS, MODELS, NOT_MODEL_SETTINGS, parameters, settings_schema
from lst_lightning.heads import FactoredSphericalHead
from lst_lightning.heads.preconditioner import Preconditioner
from lst_lightning.spherical.stabiliser import Stabiliser

from app_configs import CONF, cfg_of, group


def own_keys(node: dict, schema: dict, path: str = "") -> list[str]:
    """The keys a config file sets to its schema's default (a restated default)."""
    out = []
    for key, value in node.items():
        if key == "defaults" or key not in schema:
            continue
        if isinstance(value, dict) and isinstance(schema[key], dict):
            out += own_keys(value, schema[key], f"{path}{key}.")
        elif value == schema[key]:
            out.append(f"{path}{key}={value!r}")
    return out


@pytest.mark.parametrize("name", group("head"))
def test_a_head_config_restates_no_default_of_the_code(name):
    text = yaml.safe_load((CONF / "head" / f"{name}.yaml").read_text())
    head = text.get("head", text)  # a baseline's file is a _global_ package: head and optimizer.head_lr
    target = cfg_of(f"head={name}").head._target_
    package, cls_name = target.rsplit(".", 1)
    schema = OmegaConf.to_container(OmegaConf.structured(settings_schema(getattr(__import__(package, fromlist=[cls_name]),
                                                                              cls_name), target)))
    assert not own_keys(head, schema), f"conf/head/{name}.yaml restates the code's defaults"
    assert "optimizer" not in text or text["optimizer"]["head_lr"] is not None  # null is config.yaml's


@pytest.mark.parametrize("name", group("model"))
def test_a_model_config_restates_no_default_of_the_code(name):
    text = yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())
    package, cls_name = cfg_of(f"model={name}").model._target_.rsplit(".", 1)
    cls = getattr(__import__(package, fromlist=[cls_name]), cls_name)
    schema = OmegaConf.to_container(OmegaConf.structured(settings_schema(cls, cls_name, NOT_MODEL_SETTINGS)))
    assert not own_keys(text, schema), f"conf/model/{name}.yaml restates the code's defaults"
    assert set(MODELS["lst_lightning.models"]) >= {cls_name}


@pytest.mark.parametrize("name", group("loss"))
def test_a_loss_config_restates_nothing(name):
    """A loss file sets nothing but its schema."""
    cfg = yaml.safe_load((CONF / "loss" / f"{name}.yaml").read_text())
    assert set(cfg) == {"defaults"}


def test_the_sampled_loss_turns_on_the_spherical_heads_negatives_only():
    """loss=sampled (the default) gives the spherical heads their negatives at the code's
    defaults (head/negatives/sampled.yaml is empty); the other heads never see the key, and
    the other losses leave it null (off)."""
    assert yaml.safe_load((CONF / "head" / "negatives" / "sampled.yaml").read_text()) == {}
    for head in ("factored", "naive"):
        assert cfg_of(f"head={head}").head.negatives.num is None
        assert cfg_of(f"head={head}", "loss=zloss").head.negatives is None
        assert cfg_of(f"head={head}", "head.negatives.num=8").head.negatives.num == 8
    for head in ("softmax", "sampled", "hsoftmax", "adaptive"):
        assert "negatives" not in cfg_of(f"head={head}").head


def test_the_sampled_loss_turns_on_the_spherical_heads_preconditioner():
    """loss=sampled (the default) gives the spherical heads the right preconditioner at the
    code's defaults (head/preconditioner/sampled.yaml is empty); null turns it off; the other
    losses leave it off unless head/preconditioner=sampled; the sampled softmax has it off but for
    head=sampled_preconditioned; the other heads never see the key."""
    assert yaml.safe_load((CONF / "head" / "preconditioner" / "sampled.yaml").read_text()) == {}
    defaults = dataclasses.asdict(Preconditioner())
    for head in ("factored", "naive"):
        assert dict(cfg_of(f"head={head}").head.preconditioner) == defaults
        assert cfg_of(f"head={head}", "head.preconditioner=null").head.preconditioner is None
        assert cfg_of(f"head={head}", "head.preconditioner.damping=0.3").head.preconditioner.damping == 0.3
        assert cfg_of(f"head={head}", "loss=zloss").head.preconditioner is None
        assert dict(cfg_of(f"head={head}", "loss=zloss", "head/preconditioner=sampled").head.preconditioner) == defaults
    assert cfg_of("head=sampled").head.preconditioner is None
    cfg = cfg_of("head=sampled_preconditioned")
    assert dict(cfg.head.preconditioner) == defaults
    assert (cfg.optimizer.head_rows, cfg.optimizer.head_lr) == ("row_sgd", 16)
    for head in ("softmax", "hsoftmax", "adaptive"):
        assert "preconditioner" not in cfg_of(f"head={head}").head


def test_the_schemas_are_the_constructors():
    """Every keyword setting of each head's constructor chain is a key, at its default; the
    factored head's stabiliser is the Stabiliser dataclass's fields."""
    for package, names in HEADS.items():
        for name in names:
            cls = getattr(__import__(package, fromlist=[name]), name)
            fields = {f.name for f in dataclasses.fields(settings_schema(cls, name))} - {"_target_"}
            assert fields == set(parameters(cls)), name
    cfg = cfg_of("head=factored").head
    assert dict(cfg.stabiliser) == dataclasses.asdict(Stabiliser())
    sig = inspect.signature(FactoredSphericalHead.__init__).parameters
    assert (cfg.sync_every, cfg.parallel) == (sig["sync_every"].default, sig["parallel"].default)
    assert cfg.step == "auto"  # the app's choice by device (app/step_choice.py); the code's default is autograd
    assert sig["step"].default == "autograd"


def test_every_setting_is_a_key_that_refuses_a_typo():
    cfg = cfg_of("head.sync_every=4", "head.stabiliser.sv_min=0.3", "loss=zloss", "loss.kwargs.eps=0.001")
    assert (cfg.head.sync_every, cfg.head.stabiliser.sv_min, cfg.loss.kwargs.eps) == (4, 0.3, 0.001)
    assert cfg_of("head=naive", "head.init_std=0.1").head.init_std == 0.1
    assert cfg_of("head=sampled", "head.num_samples=8").head.num_samples == 8
    assert cfg_of("model=gpt", "model.num_heads=2").model.num_heads == 2
    # (+head.sync_evry=4 is added by Hydra, and refused by the constructor when the head is built)
    for bad in ("head.sync_evry=4", "head.stabiliser.sv_mn=0.3", "head.sync_every=four", "loss.kwargs.c=1",
                "model.embed_dmi=3"):
        with pytest.raises(ConfigCompositionException):
            cfg_of(bad)


def test_a_setting_that_is_a_bool_or_a_word_keeps_a_bool():
    """``compile_step: bool | str = "auto"``: ``head.compile_step=true`` is the bool the head
    takes, not the word 'True' it refuses."""
    for value, want in (("true", True), ("false", False), ("auto", "auto")):
        got = cfg_of(f"head.compile_step={value}").head.compile_step
        assert (got, type(got)) == (want, type(want))


def test_a_setting_that_is_a_word_or_a_list_takes_a_list():
    """``batch_sizes: str | tuple[int, ...] = "pow2"``: ``head.batch_sizes=[512,1000]`` reaches the
    head as the sizes docs/factored_head.md documents, and the head takes them."""
    import torch  # noqa: PLC0415

    from lst_lightning.app.train import make_head  # noqa: PLC0415

    cfg = cfg_of("head.batch_sizes=[512,1000]")
    assert list(cfg.head.batch_sizes) == [512, 1000]
    assert cfg_of().head.batch_sizes == "pow2"
    assert tuple(make_head(cfg, 50, 4, torch.ones(50)).batch_sizes) == (512, 1000)


@pytest.mark.parametrize("head", ["factored", "naive"])
def test_an_exact_heads_own_clipping_is_off_unless_asked_and_then_reaches_the_head(head):
    """``head.clip_norm``: null by default (the trainer's clipping bounds the body and the
    other heads' rows, not this head's step); a value, or the trainer's by interpolation,
    reaches the head's plan."""
    import torch  # noqa: PLC0415

    from lst_lightning.app.train import make_head  # noqa: PLC0415

    cfg = cfg_of(f"head={head}")
    assert cfg.head.clip_norm is None and make_head(cfg, 50, 4, torch.ones(50)).plan.clip_norm is None
    on = cfg_of(f"head={head}", "head.clip_norm=${trainer.gradient_clip_val}")
    assert on.head.clip_norm == 1.0 and make_head(on, 50, 4, torch.ones(50)).plan.clip_norm == 1.0
