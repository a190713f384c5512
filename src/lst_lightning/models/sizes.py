"""The bodies' settings checked when a body is built: each size a whole number >= 1 and the
dropout in [0, 1), refused in one line naming ``model.<key>`` (torch's own errors for them name
no setting, or come later: a zero-width layer is built with a warning only)."""
from __future__ import annotations

from collections.abc import Sequence


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_sizes(dropout: float = 0.0, **sizes: int | Sequence[int]) -> None:
    """``sizes``: ``model.<key>`` to a whole number, or a list of them (``hidden_sizes``)."""
    for key, value in sizes.items():
        many = isinstance(value, (list, tuple))
        if not all(map(_whole, value if many else [value])):
            want = "a list of whole numbers" if many else "a whole number"
            raise ValueError(f"model.{key}={list(value) if many else value!r}: must be {want} >= 1")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"model.dropout={dropout!r}: must be a number in [0, 1)")
