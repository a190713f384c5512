"""The heads', the bodies' and the losses' settings as Hydra structured configs, made from
the code.

Each default is written once, in the code: a head's constructor (and the dataclass it
takes, the factored head's ``Stabiliser``), a body's, a loss's. This module turns each
signature into a dataclass and registers it in Hydra's ConfigStore (group
``schema/head``: one per head class; ``schema/model``: one per body; ``schema/loss``: one
per loss), and the entries of ``conf/head``, ``conf/model`` and ``conf/loss`` extend them,
saying only what the app sets otherwise. So every setting is a key at the code's default
(``lst-train --cfg job`` shows them), ``head.sync_every=4`` or ``head.stabiliser.sv_min=0.3``
needs no ``+``, a typo (``head.sync_evry=4``) fails, and a value of the wrong type too.

``configs.config_dir()``, which every composition of the app's configs asks for its
directory (the console script's, a test's, a script's), registers them first. This
module imports the heads, so torch (not Lightning)."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from ..losses import LOSSES
from ..spherical.settings import AUTO

# The head classes the app names (conf/head), by the package a config's _target_ imports them from.
HEADS = {
    "lst_lightning.spherical": ("FactoredSphericalHead", "NaiveSphericalHead"),
    "lst_lightning.baselines": ("SoftmaxHead", "HierarchicalSoftmaxHead", "AdaptiveSoftmaxHead", "SampledSoftmaxHead"),
}
# The bodies (conf/model).
MODELS = {"lst_lightning.models": ("NgramMLP", "LSTMBody", "GPT")}
# Given by the app when it builds a head or a body (the data's sizes and counts).
NOT_SETTINGS = {"self", "num_classes", "hidden_dim", "class_counts"}
NOT_MODEL_SETTINGS = {"self", "vocab_size", "context_size"}
# The values a config holds as they are; a default of another kind (an object: the spherical
# heads' dtype=torch.float32) is null in the schema, and null there means the code's default.
CONFIG_VALUES = (type(None), bool, int, float, str, tuple, list, dict)


def not_null_defaults(cls: type) -> set[str]:
    """The settings of ``cls`` whose default is not null: a null one in a config means the
    code's default (an object's, such as dtype=torch.float32), so it is left out of the call.
    Not OFF_WHEN_NULL's: null there is off, as in the code."""
    return {name for name, (p, _) in parameters(cls).items() if p.default is not None} - OFF_WHEN_NULL


def parameters(cls: type, given: set[str] = NOT_SETTINGS) -> dict[str, tuple[inspect.Parameter, dict]]:
    """The settings of ``cls``'s constructor with their defaults: its own and those of the
    constructors it hands ``**kwargs`` on to (the subclass's default wins); each with the
    namespace of its module (to resolve the annotation)."""
    chain = []  # (parameters, module namespace) of each constructor down the **kwargs chain
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if klass is object or klass.__module__.split(".")[0] == "torch":
            break  # nn.Module: no settings
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())
        chain.append((params, init.__globals__))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    out: dict[str, tuple[inspect.Parameter, dict]] = {}
    for params, namespace in reversed(chain):  # the base's settings first, as a reader meets them
        for p in params:
            if p.name not in given and p.default is not p.empty:
                out[p.name] = (p, namespace)
    return out


def _nested_dataclass(p: inspect.Parameter, namespace: dict) -> type | None:
    """The dataclass a parameter's annotation names (``stabiliser: Stabiliser | dict | None``)."""
    names = str(p.annotation).replace(" ", "").split("|") if p.annotation is not p.empty else []
    found = [namespace.get(n) for n in names]
    return next((t for t in found if isinstance(t, type) and dataclasses.is_dataclass(t)), None)


# Settings taken as a dataclass where null means "none" (the spherical heads' sampled
# classes, their preconditioner), not "the dataclass's defaults" (the factored head's
# stabiliser): nullable in the schema, null by default where the constructor's default is
# None or AUTO (on with a loss that samples classes: the app's head files take them from
# the loss group's choice, conf/head/negatives, conf/head/preconditioner), else the
# dataclass's defaults; checked against the dataclass's fields when given.
OFF_WHEN_NULL = {"negatives", "preconditioner"}


def _field(name: str, default, nested: type | None = None, annotation=inspect.Parameter.empty) -> tuple:
    """A dataclass field for one setting: typed by its default (bool, int, float, str; else
    Any; Any too where a string default's annotation admits more than a string,
    ``compile_step: bool | str = "auto"`` or ``batch_sizes: str | tuple[int, ...] = "pow2"``, so
    that ``true`` stays a bool and ``[512, 1024]`` a list), a nested dataclass for a dataclass's
    settings (null by default for OFF_WHEN_NULL)."""
    if nested is not None:
        schema = mirror(nested)
        if name in OFF_WHEN_NULL:  # noqa: UP045 below (OmegaConf reads Optional)
            return name, Optional[schema], (dataclasses.field(default=None) if default in (None, AUTO)  # noqa: UP045
                                            else dataclasses.field(default_factory=schema))
        return name, schema, dataclasses.field(default_factory=schema)
    admits = set() if annotation is inspect.Parameter.empty else set(str(annotation).replace(" ", "").split("|"))
    if isinstance(default, str) and admits - {"str", "None"}:
        return name, Any, dataclasses.field(default=default)
    if isinstance(default, (bool, int, float, str)):
        return name, type(default), dataclasses.field(default=default)
    if isinstance(default, (tuple, list, dict)):
        value = list(default) if isinstance(default, tuple) else default
        return name, Any, dataclasses.field(default_factory=lambda: value.copy())
    return name, Any, dataclasses.field(default=default if isinstance(default, CONFIG_VALUES) else None)


def mirror(cls: type) -> type:
    """A settings dataclass's fields with its defaults, mutable (a frozen dataclass would make
    the config read-only) and typed as Hydra reads them."""
    fields = [_field(f.name, f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
              for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Settings", fields)


def settings_schema(cls: type, target: str, given: set[str] = NOT_SETTINGS) -> type:
    """``cls``'s settings as a dataclass, with its ``_target_`` (a head's, or with
    ``given=NOT_MODEL_SETTINGS`` a body's)."""
    fields = [("_target_", str, dataclasses.field(default=target))]
    fields += [_field(name, p.default, _nested_dataclass(p, ns), p.annotation)
               for name, (p, ns) in parameters(cls, given).items()]
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


# The keys of a loss's entry (conf/loss): its name, and its settings under kwargs.
LOSS_KEYS = ("name", "kwargs")


def loss_schema(cls: type) -> type:
    """A loss's entry: its ``name`` and, under ``kwargs``, its constructor's settings."""
    kwargs = dataclasses.make_dataclass(
        f"{cls.__name__}Kwargs", [_field(name, p.default) for name, (p, _) in parameters(cls).items()])
    return dataclasses.make_dataclass(f"{cls.__name__}Config", [
        ("name", str, dataclasses.field(default=cls.name)),
        ("kwargs", kwargs, dataclasses.field(default_factory=kwargs))])


def loss_parameters() -> set[str]:
    """The settings some loss takes under ``loss.kwargs`` (a, b, eps, ...)."""
    return {name for cls in LOSSES.values() for name in parameters(cls)}


@functools.cache
def register() -> None:
    """Every head's and loss's schema in Hydra's ConfigStore (once)."""
    store = ConfigStore.instance()
    for group, classes, given in (("head", HEADS, NOT_SETTINGS), ("model", MODELS, NOT_MODEL_SETTINGS)):
        for package, names in classes.items():
            module = importlib.import_module(package)
            for name in names:
                store.store(group=f"schema/{group}", name=name,
                            node=settings_schema(getattr(module, name), f"{package}.{name}", given))
    for name, cls in LOSSES.items():
        store.store(group="schema/loss", name=name, node=loss_schema(cls))
