"""The settings of a config group without a schema (``data``), checked against the annotations
of the constructor they go to, so that a value of the wrong type (``data.vocab_size=abc``) is
refused in one line naming its key before anything is read, not deep inside the code."""
from __future__ import annotations

import inspect

from omegaconf import DictConfig, OmegaConf

# an annotation's names, as ``from __future__ import annotations`` keeps them: what each accepts, in words
KINDS = {"int": ((int,), "an int"), "float": ((int, float), "a number"), "str": ((str,), "a string"),
         "bool": ((bool,), "true or false"), "None": ((type(None),), "null"), "list": ((list, tuple), "a list"),
         "tuple": ((list, tuple), "a list"), "dict": ((dict,), "a mapping")}


def accepted(annotation) -> tuple[tuple[type, ...], str] | None:
    """The types an annotation such as ``int | None`` accepts and their words ("an int or null"),
    or None where it names anything else (a class, a bare parameter): such a setting is left to
    the code."""
    if annotation is inspect.Parameter.empty or not isinstance(annotation, str):
        return None
    found = [KINDS.get(part.split("[")[0]) for part in annotation.replace(" ", "").split("|")]
    if not found or None in found:
        return None
    return tuple(t for kinds, _ in found for t in kinds), " or ".join(dict.fromkeys(w for _, w in found))


def check_setting_types(section: DictConfig, cls: type, group: str) -> None:
    """Each key of ``section`` that ``cls``'s constructor annotates with plain types must hold one
    of them (a bool is not an int); else one ValueError naming ``<group>.<key>``."""
    params = inspect.signature(cls.__init__).parameters
    values = OmegaConf.to_container(section, resolve=True)
    for key, value in values.items():
        p = params.get(key)
        found = accepted(p.annotation) if p is not None else None
        if found is None:
            continue
        kinds, want = found
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise ValueError(f"{group}.{key}={value!r}: must be {want}")
