"""Which project files and functions one training step of a head enters.

``python scripts/trace_step.py`` builds a ``FactoredSphericalHead`` (bias column; the
Z-loss, or with ``--loss sampled`` lst-train's default, sampled classes inside the step and
the right preconditioner),
takes one warm-up step, then traces one more ``head(H, idx).backward()`` with
``sys.setprofile`` and prints every file of ``src/`` and ``triton_kernels/`` it enters,
with the functions (lambdas and comprehensions count: each is a call a reader follows).
tests/spherical/test_step_path.py holds the Z-loss step to at most 8 files and 45 functions,
and the default loss=sampled's step to 12 files and 61 functions.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def trace_step(head, H, idx) -> dict[str, set[str]]:
    """{file relative to the repository: functions} entered by one ``head(H, idx).backward()``."""
    import lst_kernels
    import lst_lightning
    # the folders holding the two packages (src/ and triton_kernels/, or site-packages)
    roots = {str(Path(m.__file__).resolve().parents[1]) for m in (lst_lightning, lst_kernels)}
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        if event == "call":
            path = os.path.abspath(frame.f_code.co_filename)
            root = next((r for r in roots if path.startswith(r + os.sep)), None)
            if root is not None:
                seen.setdefault(os.path.relpath(path, os.path.dirname(root)), set()).add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        head(H, idx).backward()
    finally:
        sys.setprofile(None)
    return seen


def default_step_path(num_classes: int = 1000, hidden_dim: int = 16, m: int = 8, k: int = 1, loss: str = "zloss"):
    """The trace of the factored head's second training step (the first one warms up), with
    ``loss`` ("zloss": the spherical step; "sampled": lst-train's default, its negatives and
    preconditioner on)."""
    import torch

    from lst_lightning.spherical import FactoredSphericalHead
    g = torch.Generator().manual_seed(0)
    head = FactoredSphericalHead(num_classes=num_classes, hidden_dim=hidden_dim, loss=loss, bias=True,
                                 generator=g, negatives={} if loss == "sampled" else None,
                                 preconditioner={} if loss == "sampled" else None)
    H = torch.randn(m, hidden_dim, generator=g, requires_grad=True)
    idx = torch.randint(0, num_classes, (m, k), generator=g)
    head(H, idx).backward()
    return trace_step(head, H, idx)


def main(argv=None) -> None:
    # the defaults are default_step_path's: an option left out is not passed
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    p.add_argument("--num-classes", type=int)
    p.add_argument("--hidden-dim", type=int)
    p.add_argument("-m", type=int, help="rows in the batch")
    p.add_argument("-k", type=int, help="targets per row")
    p.add_argument("--loss", choices=["zloss", "sampled"], help="the Z-loss (default) or loss=sampled")
    seen = default_step_path(**vars(p.parse_args(argv)))
    print(f"{len(seen)} files, {sum(len(v) for v in seen.values())} functions")
    for path, names in sorted(seen.items()):
        print(f"{path} ({len(names)}): {', '.join(sorted(names))}")


if __name__ == "__main__":
    main()
