"""A head's warnings at the user's line: ``warn`` points a warning at the first frame outside
this package and torch (the user's code, or the training loop's that called the head), wherever
in the head it is raised: in a step's backward, at the flags' read, in a load. A fixed
``stacklevel`` points inside torch on one route (its ``no_grad`` wrapper, the autograd engine's
call of the backward) and inside the head on another."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

#: the folders whose frames a warning skips: this package's and torch's, as their code objects name
#: them (the paths they were imported from, links unresolved)
INSIDE = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside ``INSIDE`` (where none is,
    the outermost: a backward run on autograd's own thread)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
