"""Which project files and functions one training step of a head enters, and the branches of
its device part.

``python scripts/trace_step.py`` builds a ``FactoredSphericalHead`` (bias column; the
Z-loss, or with ``--loss sampled`` lst-train's default, sampled classes inside the step and
the right preconditioner),
takes one warm-up step, then traces one more ``head(H, idx).backward()`` with
``sys.setprofile`` and prints every file of ``src/`` and ``triton_kernels/`` it enters,
with the functions (lambdas and comprehensions count: each is a call a reader follows).
tests/spherical/test_step_path.py holds the Z-loss step to at most 8 files and 39 functions,
and the default loss=sampled's step to 12 files and 57 functions.

It counts the branches of the step's device part too: the functions entered below driver.py's ``run``
(what ``run_device_part`` and ``forward_step`` run, compiled whole where the plan says:
``device_step``, or the autograd step's halves ``forward`` and ``update``), not the host driver
around it. A branch is an ``if`` (each ``elif`` one more), a conditional expression, a
comprehension's ``if``, and an ``and``/``or`` outside a branch's test (its short circuit picks
a value; inside a test it is part of that one test), a ``while``'s test as an ``if``'s; ``for``
loops and ``try`` are not counted. Each
is read by ``ast`` from its function's source and classed by its test:
- on tensors' values: the test converts a tensor on the host (``bool``, ``float``, ``int``,
  ``.item()``, ``.tolist()``, or a name bound from one in that function), or the
  trace saw a tensor read on the host (``Tensor.__bool__``, ``__float__``, ``__int__``,
  ``__index__``, ``item``, ``tolist``, caught by a ``TorchFunctionMode``) while the test ran (an
  ``if tensor:`` included);
- on the plan: any other test, which reads Python values only: the plan and the settings it
  holds (the loss's, the draw's), the batch's shapes and dtypes, ``is None`` of optional inputs,
  static attributes (``fwd.neg.shared``), its note says which of these the test reads.
Every branch is listed with its file:line, the step's own (``src/``) apart from the kernel ops
(``triton_kernels/``: the implementation the plan chose, ``plan.kernels``, unchecked).
tests/spherical/test_step_path.py holds the counts: the step's own, 10 branches in 16 functions
with the Z-loss and 15 in 31 with loss=sampled, every one on the plan (the write masked by the
device flags on every device); the kernel ops' 5 in 9 and 6 in 10, the CPU's gated fold reading
its flag among them (``fold_rows_``: on CUDA a Triton kernel reads it on the device).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gc
import os
import sys
from pathlib import Path
from typing import NamedTuple

#: the calls that convert a tensor to a Python value on the host
HOST_CALLS = {"bool", "float", "int"}
HOST_METHODS = {"item", "tolist"}
#: the tensor methods that read a value on the host, as a ``TorchFunctionMode`` sees them
HOST_READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist"}


@functools.cache
def qualname(code) -> str:
    """A code object's qualified name (``Class.method``, ``f.<locals>.g``): ``co_qualname`` from
    Python 3.11; on 3.10 that of the function that holds it."""
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    held = [f for f in gc.get_referrers(code) if getattr(f, "__code__", None) is code]
    return held[0].__qualname__ if held else code.co_name


def trace_step(head, H, idx, device: dict | None = None) -> dict[str, set[str]]:
    """{file relative to the repository: functions} entered by one ``head(H, idx).backward()``.
    ``device``: filled with the device part's (below driver.py's ``run``) code objects ("codes")
    and the project lines ({file: lines}) on the stack of each tensor read on the host ("reads")."""
    from torch.overrides import TorchFunctionMode

    import lst_kernels
    import lst_lightning
    from lst_lightning.spherical import driver
    # the folders holding the two packages (src/ and triton_kernels/, or site-packages)
    roots = {str(Path(m.__file__).resolve().parents[1]) for m in (lst_lightning, lst_kernels)}
    seen: dict[str, set[str]] = {}
    codes, reads = ({}, {}) if device is None else (device.setdefault("codes", {}), device.setdefault("reads", {}))

    def relative(path: str) -> str | None:
        path = os.path.abspath(path)
        root = next((r for r in roots if path.startswith(r + os.sep)), None)
        return None if root is None else os.path.relpath(path, os.path.dirname(root))

    def below_run(frame) -> bool:
        frame = frame.f_back
        while frame is not None and frame.f_code is not driver.run.__code__:
            frame = frame.f_back
        return frame is not None

    def profile(frame, event, arg):
        if event == "call":
            path = relative(frame.f_code.co_filename)
            if path is not None:
                seen.setdefault(path, set()).add(qualname(frame.f_code))
                if device is not None and below_run(frame):
                    codes[path, qualname(frame.f_code), frame.f_code.co_firstlineno] = frame.f_code

    class HostReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) in HOST_READS and below_run(sys._getframe()):
                frame = sys._getframe(1)
                while frame is not None and frame.f_code is not driver.run.__code__:
                    path = relative(frame.f_code.co_filename)
                    if path is not None:
                        reads.setdefault(path, set()).add(frame.f_lineno)
                    frame = frame.f_back
            return func(*args, **(kwargs or {}))

    with HostReads() if device is not None else contextlib.nullcontext():
        sys.setprofile(profile)
        try:
            head(H, idx).backward()
        finally:
            sys.setprofile(None)
    return seen


def default_step_path(num_classes: int = 1000, hidden_dim: int = 16, m: int = 8, k: int = 1, loss: str = "zloss",
                      device: dict | None = None):
    """The trace of the factored head's second training step (the first one warms up), with
    ``loss`` ("zloss": the spherical step; "sampled": lst-train's default, its negatives and
    preconditioner on); ``device``: as ``trace_step`` fills it."""
    import torch

    from lst_lightning.spherical import FactoredSphericalHead
    g = torch.Generator().manual_seed(0)
    head = FactoredSphericalHead(num_classes=num_classes, hidden_dim=hidden_dim, loss=loss, bias=True,
                                 generator=g, negatives={} if loss == "sampled" else None,
                                 preconditioner={} if loss == "sampled" else None)
    H = torch.randn(m, hidden_dim, generator=g, requires_grad=True)
    idx = torch.randint(0, num_classes, (m, k), generator=g)
    head(H, idx).backward()
    return trace_step(head, H, idx, device)


# -- the device part's branches -------------------------------------------------------------------
class Branch(NamedTuple):
    file: str       # relative to the repository
    line: int
    function: str   # its qualified name
    kind: str       # "if", "if-else" (a conditional expression), "comprehension if", "and/or"
    on: str         # "plan" or "values" (tensors' values)
    note: str       # what the test reads
    test: str       # its source


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.GeneratorExp, ast.ListComp,
           ast.SetComp, ast.DictComp)
_NAMES = {ast.FunctionDef: None, ast.AsyncFunctionDef: None, ast.Lambda: "<lambda>", ast.GeneratorExp: "<genexpr>",
          ast.ListComp: "<listcomp>", ast.SetComp: "<setcomp>", ast.DictComp: "<dictcomp>"}


def _function_node(tree: ast.AST, qualname: str, first_line: int):
    """The node of the function whose code object is (``qualname``, ``first_line``): a def's first
    line is its first decorator's."""
    name = qualname.rsplit(".", 1)[-1]
    for node in ast.walk(tree):
        if type(node) in _NAMES and (_NAMES[type(node)] or node.name) == name:
            lines = [node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]
            if min(lines) == first_line:
                return node
    return None


def _branches(node) -> list[tuple[str, ast.AST, ast.expr]]:
    """(kind, node, test) of each branch in the function ``node``'s own code (not its nested
    functions, lambdas and comprehensions: each is a code object of its own)."""
    found = []

    def walk(n, in_test: bool) -> None:
        if isinstance(n, (ast.If, ast.While)):
            found.append(("if" if isinstance(n, ast.If) else "while", n, n.test))
            walk(n.test, True)
            for child in n.body + n.orelse:
                walk(child, False)
            return
        if isinstance(n, ast.IfExp):
            found.append(("if-else", n, n.test))
            walk(n.test, True)
            walk(n.body, in_test)
            walk(n.orelse, in_test)
            return
        if isinstance(n, ast.BoolOp) and not in_test:
            found.append(("and/or", n, n))
            in_test = True  # its operands are its test
        if isinstance(n, ast.comprehension):
            for test in n.ifs:
                found.append(("comprehension if", test, test))
                walk(test, True)
            walk(n.iter, in_test)
            return
        for child in ast.iter_child_nodes(n):
            if not isinstance(child, _SCOPES):
                walk(child, in_test)

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for stmt in node.body:
            walk(stmt, False)
    elif isinstance(node, ast.Lambda):
        walk(node.body, False)
    else:  # a comprehension: its generators' ifs and its element
        for gen in node.generators:
            walk(gen, False)
        for part in ("elt", "key", "value"):
            if getattr(node, part, None) is not None:
                walk(getattr(node, part), False)
    return found


def _converts(expr: ast.AST, bound: set[str]) -> bool:
    """Whether ``expr`` converts a value on the host (``HOST_CALLS``, ``HOST_METHODS``) or reads a
    name ``bound`` from such a conversion."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Call) and ((isinstance(n.func, ast.Name) and n.func.id in HOST_CALLS)
                                        or (isinstance(n.func, ast.Attribute) and n.func.attr in HOST_METHODS)):
            return True
        if isinstance(n, ast.Name) and n.id in bound:
            return True
    return False


def _bound_from_reads(node) -> set[str]:
    """The names the function ``node`` binds from a conversion on the host (to a fixed point)."""
    bound: set[str] = set()
    assigns = [n for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))]
    while True:
        more = {t.id for a in assigns if a.value is not None and _converts(a.value, bound)
                for target in (a.targets if isinstance(a, ast.Assign) else [a.target])
                for t in ast.walk(target) if isinstance(t, ast.Name)} - bound
        if not more:
            return bound
        bound |= more


_SHAPES = {"shape", "dim", "dtype", "device", "is_cuda", "numel", "is_floating_point", "stride"}


def _assigned(node) -> dict[str, list[ast.expr]]:
    """{name: the values the function ``node`` binds it to} (its own assignments and loops)."""
    out: dict[str, list[ast.expr]] = {}
    for n in ast.walk(node):
        pairs = ([(t, n.value) for t in n.targets] if isinstance(n, ast.Assign) else
                 [(n.target, n.value)] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) and n.value is not None else
                 [(n.target, n.iter)] if isinstance(n, (ast.For, ast.comprehension)) else [])
        while any(isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts)
                  for t, v in pairs):  # a, b = x, y: a from x, b from y
            pairs = [q for t, v in pairs for q in (zip(t.elts, v.elts) if isinstance(t, ast.Tuple) and
                                                   isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts)
                                                   else [(t, v)])]
        for target, value in pairs:
            for t in ast.walk(target):
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(value)
    return out


def _note(test: ast.AST, assigned: dict[str, list[ast.expr]]) -> str:
    """What a test on the plan reads, with the values its names are bound to in the function:
    the plan or the settings of one of its parts (``plan``, ``self``), shapes and types, ``is
    None`` of an optional input, whether the step is being compiled; else arguments and constants."""
    exprs, todo, seen = [], [test], set()
    while todo:
        e = todo.pop()
        exprs.append(e)
        for n in ast.walk(e):
            if isinstance(n, ast.Name) and n.id in assigned and n.id not in seen:
                seen.add(n.id)
                todo.extend(assigned[n.id])
    nodes = [n for e in exprs for n in ast.walk(e)]
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    attrs = {n.attr for n in nodes if isinstance(n, ast.Attribute)}
    notes = []
    if names & {"plan", "self"} or "plan" in attrs:
        notes.append("plan/settings")
    if attrs & _SHAPES or names & {"isinstance", "len"}:
        notes.append("shape/type")
    if any(isinstance(n, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot)) for o in n.ops) for n in nodes):
        notes.append("optional")
    if "is_compiling" in attrs:
        notes.append("compiling")
    return ", ".join(notes) or "argument/constant"


def device_branches(device: dict) -> list[Branch]:
    """Every branch of the functions in ``device`` (``trace_step``'s), classed by its test."""
    out = []
    for (path, qualname, first), code in sorted(device["codes"].items()):
        tree = ast.parse(Path(code.co_filename).read_text())
        node = _function_node(tree, qualname, first)
        if node is None:
            raise LookupError(f"{path}:{first}: no function {qualname} in its source")
        bound, assigned, lines = _bound_from_reads(node), _assigned(node), device["reads"].get(path, set())
        source = Path(code.co_filename).read_text()
        for kind, n, test in _branches(node):
            read = _converts(test, bound) or any(test.lineno <= i <= test.end_lineno for i in lines)
            text = " ".join(ast.get_source_segment(source, test).split())
            note = "a tensor read on the host" if read else _note(test, assigned)
            out.append(Branch(path, n.lineno, qualname, kind, "values" if read else "plan", note, text))
    return sorted(out)


def summary(device: dict, branches: list[Branch], part: str = "") -> str:
    """"N functions, B branches: P on the plan, T on tensors' values" of the files under ``part``."""
    functions = sum(1 for key in device["codes"] if key[0].startswith(part))
    mine = [b for b in branches if b.file.startswith(part)]
    values = sum(b.on == "values" for b in mine)
    return f"{functions} functions, {len(mine)} branches: {len(mine) - values} on the plan, {values} on tensors' values"


def main(argv=None) -> None:
    # the defaults are default_step_path's: an option left out is not passed
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], argument_default=argparse.SUPPRESS)
    p.add_argument("--num-classes", type=int)
    p.add_argument("--hidden-dim", type=int)
    p.add_argument("-m", type=int, help="rows in the batch")
    p.add_argument("-k", type=int, help="targets per row")
    p.add_argument("--loss", choices=["zloss", "sampled"], help="the Z-loss (default) or loss=sampled")
    device: dict = {}
    seen = default_step_path(**vars(p.parse_args(argv)), device=device)
    print(f"{len(seen)} files, {sum(len(v) for v in seen.values())} functions")
    for path, names in sorted(seen.items()):
        print(f"{path} ({len(names)}): {', '.join(sorted(names))}")
    branches = device_branches(device)
    print(f"\ndevice part: {summary(device, branches)}")
    print(f"  the step's own (src/): {summary(device, branches, 'src/')}")
    print(f"  the kernel ops (triton_kernels/): {summary(device, branches, 'triton_kernels/')}")
    for b in branches:
        print(f"{b.file}:{b.line} {b.function} {b.kind}: {b.on} ({b.note}): {b.test}")


if __name__ == "__main__":
    main()
