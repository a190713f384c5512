"""A spherical head's settings: when its nested ones (``Negatives``, ``Preconditioner``) are on by
default (``AUTO``), and the ones a training loop may change, as attributes validated when set
(``Setting``, ``Driven``). The nested ones are read by ``heads.settings.settings_from``."""
from __future__ import annotations

import math

#: a nested setting's default on the spherical heads (negatives, preconditioner): on at the
#: dataclass's defaults with a loss that samples classes (the default, ``loss="sampled"``),
#: off with the other losses
AUTO = "auto"


def on_with_sampled(value, sampled: bool):
    """``value``, or for ``AUTO`` the settings' defaults (``{}``) when the loss samples classes
    and None (off) when it does not."""
    if isinstance(value, str) and value == AUTO:
        return {} if sampled else None
    return value


class Setting:
    """A head's setting as an attribute: ``check(value)`` refuses a bad value in one line and gives
    the value kept, at ``place`` (``"_<name>"``, or an attribute of one of the head's parts:
    ``"pending.max_rows"``); one that the step's plan holds (``planned``) changes there too (the
    head's ``_in_plan``)."""

    def __init__(self, check, place: str | None = None, planned: bool = False):
        self.check, self.place, self.planned = check, place, planned

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        *self.part, self.attr = (self.place or "_" + name).split(".")

    def _holder(self, head):
        for part in self.part:
            head = getattr(head, part)
        return head

    def __get__(self, head, owner=None):
        return self if head is None else getattr(self._holder(head), self.attr)

    def __set__(self, head, value) -> None:
        value = self.check(value)
        setattr(self._holder(head), self.attr, value)
        if self.planned:
            head._in_plan(**{self.name: value})


class Driven:
    """A field of the head's ``driving`` (driving.py) as an attribute: set through the head's
    ``_drive``, which validates it with the others and makes the step's plan again."""

    def __init__(self, field: str):
        self.field = field

    def __get__(self, head, owner=None):
        return self if head is None else getattr(head.driving, self.field)

    def __set__(self, head, value) -> None:
        head._drive(**{self.field: value})


def finite(name: str, positive: bool = True):
    """The check of a finite float, > 0 (``positive``) or >= 0."""
    def check(value) -> float:
        try:  # a number (a numpy or 0-dim torch one, a str that float() reads too), not a bool
            number = None if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not (math.isfinite(number) and (number > 0 if positive else number >= 0)):
            raise ValueError(f"{name} must be finite and {'positive' if positive else '>= 0'}, got {value!r}")
        return number
    return check


def bound_or_off(name: str):
    """The check of a finite bound > 0, or None or 0 for none (given as None): ``finite``'s of a
    number >= 0, a 0 of any kind it reads (an int, a numpy or 0-dim torch number) none."""
    nonnegative = finite(name, positive=False)

    def check(value):
        try:
            number = None if value is None else nonnegative(value)
        except ValueError:
            raise ValueError(f"{name} must be finite and positive, or None or 0 for none, got {value!r}") from None
        return number or None
    return check


def positive_int(name: str, optional: bool = False):
    """The check of a positive int (not a bool), or None where ``optional``."""
    def check(value):
        if not ((optional and value is None) or (isinstance(value, int) and not isinstance(value, bool)
                                                 and value >= 1)):
            raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")
        return value
    return check


def one_of(name: str, choices: tuple):
    """The check of one of ``choices``."""
    def check(value):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value
    return check
