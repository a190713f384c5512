"""The bodies' constructor arguments, each refused in one line naming its setting (under
lst-train: ``model: <setting> must be ...``) before any layer is built. A zero width
(``model.embed_dim=0``, ``model.hidden_sizes=[0]``, ``model.mlp_ratio=0``) would build a body
whose output does not depend on its tokens, and train it."""
from __future__ import annotations


def sizes(minimum: int = 1, **named) -> None:
    """Each of ``named`` an int of at least ``minimum`` (a list: each of its items)."""
    for name, value in named.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                got = value if isinstance(value, (list, tuple)) else v
                raise ValueError(f"{name} must be {'a positive int' if minimum == 1 else f'an int >= {minimum}'}"
                                 f"{' each' if isinstance(value, (list, tuple)) else ''}, got {got!r}")


def dropout(p) -> None:
    """A dropout probability in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {p!r}")
