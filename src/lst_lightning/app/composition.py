"""A command line that does not compose, in one line: an option a config group does not have
(``head=nosuch``: the group's choices), a key the config does not have (``data.batch_sise=3``:
the nearest key, and the ``+key=`` form that adds a new one), an override Hydra cannot parse.

Hydra prints these over several lines and exits 1. ``lst-train``'s ``main`` composes under
``raising()``, which has Hydra raise them instead (its ``HYDRA_FULL_ERROR=1``), and
``errors.py`` turns them into its one line. The task function calls ``composed()`` first:
an error raised later (while training) is Hydra's to report, as without this module. A
``HYDRA_FULL_ERROR`` the user set stands throughout (``=1``: the whole trace)."""
from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from contextlib import contextmanager

FULL_ERROR = "HYDRA_FULL_ERROR"
# Hydra's lines that say where it looked and how to see more: not the user's mistake
NOISE = ("Config search path:", "Set the environment variable HYDRA_FULL_ERROR")
APPEND = "To append to your config use "

_UNSET = object()
_given: list = []  # while raising() holds FULL_ERROR at 1 for Hydra: the user's value (or _UNSET)


@contextmanager
def raising() -> Iterator[None]:
    """Inside the block Hydra raises the errors of composing the command line, rather than
    printing them; a FULL_ERROR=1 the user set is left as it is."""
    if os.environ.get(FULL_ERROR) == "1":
        yield
        return
    _given[:] = [os.environ.get(FULL_ERROR, _UNSET)]
    os.environ[FULL_ERROR] = "1"
    try:
        yield
    finally:
        composed()


def composed() -> None:
    """The command line has composed: Hydra reports what is raised from here on, as the user's
    FULL_ERROR says (idempotent)."""
    if not _given:
        return
    given = _given.pop()
    if given is _UNSET:
        os.environ.pop(FULL_ERROR, None)
    else:
        os.environ[FULL_ERROR] = given


def _one_line(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith(NOISE):
            break
        lines.append(line)
    return " ".join(" ".join(lines).split())


def _missing_option(exc) -> str | None:
    """``head=nosuch``: Hydra's MissingConfigException names the group's file and its options."""
    group, _, option = (exc.missing_cfg_file or "").rpartition("/")
    if not group or not exc.options:
        return None
    near = difflib.get_close_matches(option, exc.options, n=1)
    hint = f"did you mean {group}={near[0]}? " if near else ""
    return f"{group}={option}: {group} has no option {option}; {hint}the choices are {', '.join(exc.options)}"


def _missing_key(exc) -> str | None:
    """``data.batch_sise=3``: the key's node says which keys there are."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError  # noqa: PLC0415

    cause = exc.__cause__
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not cause.full_key:
        return None
    parent, _, key = str(cause.full_key).rpartition(".")
    node = cause.parent_node
    keys = [str(k) for k in node.keys()] if hasattr(node, "keys") else []
    append = next((ln[len(APPEND):].strip() for ln in str(exc).splitlines() if ln.startswith(APPEND)), None)
    given = append[1:] if append else cause.full_key
    where = parent or "the config"
    near = difflib.get_close_matches(key, keys, n=1)
    if near:
        valid = f"did you mean {parent + '.' if parent else ''}{near[0]}?"
    else:
        valid = f"{where} has {', '.join(keys)}" if keys else f"{where} takes no keys"
    new = f" ({append} adds it as a new key)" if append else ""
    return f"{given}: {where} has no key {key}; {valid}{new}"


def composition_message(exc: BaseException) -> str | None:
    """One line for an error of Hydra's composing the command line, or None for another error."""
    from hydra.errors import (  # noqa: PLC0415
        CompactHydraException,
        InstantiationException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    if not isinstance(exc, CompactHydraException) or isinstance(exc, InstantiationException):
        return None
    if isinstance(exc, MissingConfigException) and (text := _missing_option(exc)):
        return text
    if text := _missing_key(exc):
        return text
    text = _one_line(str(exc))
    if isinstance(exc, OverrideParseException) and exc.override not in text:
        text = f"{exc.override}: {text}"
    if isinstance(exc.__cause__, OmegaConfBaseException):  # its first line, not its full_key/object_type lines
        text = f"{text}: {_one_line(str(exc.__cause__).splitlines()[0])}"
    return text
