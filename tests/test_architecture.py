"""The import rules of docs/architecture.md, read from the source (every import statement,
top-level or inside a function): what each part of the package must never import."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lst_lightning"
KERNELS = ROOT / "triton_kernels" / "lst_kernels"
FRAMEWORKS = {"lightning", "hydra", "omegaconf", "wandb", "datasets"}

# part -> the top-level names (third-party packages, or lst_lightning.<part>) it must never import
NEVER = {
    "heads": FRAMEWORKS | {"lst_lightning." + p for p in ("spherical", "baselines", "losses", "data", "models", "app")},
    "losses": FRAMEWORKS | {"lst_lightning." + p for p in ("heads", "spherical", "baselines", "data", "models", "app")},
    "spherical": FRAMEWORKS | {"lst_lightning." + p for p in ("baselines", "data", "models", "app")},
    "baselines": FRAMEWORKS | {"lst_lightning." + p for p in ("spherical", "losses", "data", "models", "app")},
    "models": FRAMEWORKS | {"lst_lightning." + p for p in ("heads", "spherical", "baselines", "losses", "data", "app")},
    # row-sparse tables in static shapes: torch only, below the bodies and the baselines that use them
    "rows": FRAMEWORKS | {"lst_lightning." + p for p in ("heads", "spherical", "baselines", "losses", "data", "models",
                                                         "app", "integrations")},
    # what the processes share (the process group, the fixed-size exchange): torch only, below the
    # exact head and the app
    "distributed": FRAMEWORKS | {"lst_lightning." + p for p in ("heads", "spherical", "baselines", "losses", "data",
                                                                "models", "rows", "app", "integrations")},
    "data": {"hydra", "omegaconf", "wandb"} | {"lst_lightning." + p for p in ("heads", "spherical", "baselines",
                                                                            "losses", "models", "app")},
    # the bridges to other LM stacks: the exact head and its losses, never the app or the baselines;
    # litgpt never (factor_gpt_head reads the model's attributes: the package works without the extra)
    "integrations": FRAMEWORKS | {"litgpt"} | {"lst_lightning." + p for p in ("baselines", "data", "models", "app")},
}


def imports_of(path: Path, package: str) -> set[str]:
    """Absolute dotted names imported by a module of ``package`` (relative imports resolved)."""
    here = package.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def modules(root: Path, top: str):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [top, *rel.parts]
        yield path, ".".join(parts[:-1]), parts


def forbidden(name: str, banned: set[str]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


@pytest.mark.parametrize("part", sorted(NEVER))
def test_part_never_imports_what_it_must_not(part):
    bad = []
    for path, package, parts in modules(PACKAGE / part, f"lst_lightning.{part}"):
        for name in imports_of(path, package):
            if forbidden(name, NEVER[part]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_kernels_import_only_torch_triton_and_the_standard_library():
    allowed = {"torch", "triton", "numpy", "lst_kernels", "__future__"}
    bad = []
    for path, package, _ in modules(KERNELS, "lst_kernels"):
        for name in imports_of(path, package):
            top = name.split(".")[0]
            if top not in allowed and top not in __import__("sys").stdlib_module_names:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_nothing_installable_imports_the_scripts_or_the_tests():
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    for root, top in ((PACKAGE, "lst_lightning"), (KERNELS, "lst_kernels")):
        for path, package, _ in modules(root, top):
            names = {n.split(".")[0] for n in imports_of(path, package)}
            assert not names & (scripts | {"scripts", "tests"}), path



def runtime_imports_of(path: Path, package: str) -> set[str]:
    """``imports_of`` less the imports under ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text())
    typing_only = [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    for node in typing_only:
        node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            out.add(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def top_level_imports(part: str, names: set[str]) -> list[str]:
    """Where a module of ``lst_lightning.<part>`` imports one of ``names`` at its top level."""
    bad = []
    for path, _, _ in modules(PACKAGE / part, f"lst_lightning.{part}"):
        for node in ast.parse(path.read_text()).body:
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)} imports {n} at the top" for n in found if n.split(".")[0] in names]
    return bad


def test_integrations_import_transformers_only_inside_functions():
    """The package works without the ``hf`` extra: no module of lst_lightning.integrations
    imports transformers at its top level (only inside the functions that need it)."""
    bad = top_level_imports("integrations", {"transformers"})
    assert not bad, "\n".join(bad)


def test_data_imports_datasets_and_gensim_only_inside_functions():
    """The synthetic task's data module runs where neither is installed (a GPU machine with
    torch but not the app's frameworks, docs/gpu.md): they are imported only where a corpus is loaded."""
    bad = top_level_imports("data", {"datasets", "gensim"})
    assert not bad, "\n".join(bad)


def test_no_two_modules_of_the_exact_head_import_each_other():
    """One step reads top to bottom: no module of lst_lightning.spherical imports one that
    imports it (the package's __init__, which names them all, aside)."""
    deps = {".".join(parts): runtime_imports_of(path, package)
            for path, package, parts in modules(PACKAGE / "spherical", "lst_lightning.spherical")
            if path.name != "__init__.py"}
    mutual = sorted((a, b) for a in deps for b in deps if a < b and b in deps[a] and a in deps[b])
    assert not mutual, mutual


def module_imports_of(path: Path, package: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports: at its top, inside functions and under
    ``if TYPE_CHECKING:`` alike; ``from . import name`` names the module ``name`` where it is one."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            subs = {f"{module}.{a.name}" for a in node.names} & known
            out |= subs or {module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out & known


#: every part of the package, and the kernels
PARTS = {**{p.name: (p, f"lst_lightning.{p.name}") for p in sorted(PACKAGE.iterdir()) if (p / "__init__.py").exists()},
         "lst_kernels": (KERNELS, "lst_kernels")}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_no_module_imports_itself_through_others(part):
    """No import circle in any part of the package or in the kernels, deferred imports (inside
    functions) and type hints' imports counted: a module never reaches itself by following what
    it imports."""
    root, top = PARTS[part]
    found = [(path, package if path.name == "__init__.py" else ".".join(parts), package)
             for path, package, parts in modules(root, top)]
    known = {name for _, name, _ in found}
    deps = {name: module_imports_of(path, package, known) - {name} for path, name, package in found}
    circles = []
    for start in sorted(deps):
        seen, todo = set(), list(deps[start])
        while todo:
            b = todo.pop()
            if b == start:
                circles.append(start)
                break
            if b not in seen:
                seen.add(b)
                todo += deps[b]
    assert not circles, f"modules that import themselves through others: {circles}"
