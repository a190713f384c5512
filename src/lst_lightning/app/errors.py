"""What the console scripts tell a user whose input is wrong: one line naming the
setting and what to do, exit code 2, no traceback. ``HYDRA_FULL_ERROR=1`` lets the
exception through, with its whole trace.

Bad input is what the app raises while it checks the configuration and builds the
data, the model and the trainer (ValueError, a missing file, an unreachable dataset,
an argument a constructor refuses, Lightning's MisconfigurationException); errors
raised later, while training, keep their traceback."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

# OSError's subclasses for files and the network; not OSError itself (a full disk is no bad input).
BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, ConnectionError)


def _lightning_misconfiguration(exc: BaseException) -> bool:
    """Lightning's own refusals (only importable once Lightning is: it is never imported here)."""
    mod = sys.modules.get("lightning.fabric.utilities.exceptions")
    return mod is not None and isinstance(exc, mod.MisconfigurationException)


def bad_input_message(exc: BaseException) -> str | None:
    """The one-line message for bad input, or None when ``exc`` is not bad input."""
    from hydra.errors import InstantiationException  # noqa: PLC0415
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException  # noqa: PLC0415

    from .composition import composition_message  # noqa: PLC0415

    if (text := composition_message(exc)) is not None:  # a command line that does not compose
        return text
    if isinstance(exc, InstantiationException):
        # "Error in call to target 'x.Y':\nValueError('...')\nfull_key: head": the cause, and the key.
        cause = exc.__cause__
        if not isinstance(cause, (*BAD_INPUT, TypeError)) and not _lightning_misconfiguration(cause):
            return None
        key = next((ln.split(":", 1)[1].strip() for ln in str(exc).splitlines() if ln.startswith("full_key:")), "")
        text = f"{key}: {cause}" if key else str(cause)
    elif isinstance(exc, MissingMandatoryValue):
        text = f"{exc.full_key} is not set: give it on the command line ({exc.full_key}=...)"
    elif isinstance(exc, OmegaConfBaseException):
        text = str(exc).splitlines()[0]  # without OmegaConf's full_key/object_type lines
        if exc.full_key and str(exc.full_key) not in text:  # name=${nosuch}: the key, then what is wrong with it
            text = f"{exc.full_key}: {text}"
    elif isinstance(exc, BAD_INPUT) or _lightning_misconfiguration(exc):
        text = str(exc)
    else:
        return None
    return " ".join(text.split())  # one line


@contextmanager
def exit_on_bad_input(prog: str) -> Iterator[None]:
    """Bad input raised inside the block: ``<prog>: error: <message>`` on stderr, exit 2."""
    try:
        yield
    except Exception as exc:
        msg = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else bad_input_message(exc)
        if msg is None:
            raise
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser for ``lst-compare`` and ``lst-dashboard``: an error (argparse's own, an
    unknown flag; the script's, through ``error``) is ``<prog>: error: <message>`` in one line,
    exit code 2, without argparse's usage lines (``--help`` shows them)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")
