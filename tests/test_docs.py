"""The documentation's links: every relative link of the README, the changelog and docs/ names a
file of the repository, and every #anchor a heading of that file (GitHub's slugs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "results" / "README.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", body, flags=re.M)}


def links(path: Path) -> list[str]:
    body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(body) if not re.match(r"[a-z]+://|mailto:", m.group(1))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    bad = []
    for link in links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            bad.append(link)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(link)
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


def test_slugs_are_githubs():
    assert slug("The losses (`lst_lightning.losses`)") == "the-losses-lst_lightninglosses"
    assert slug("Refused, with one line saying why (and nothing changed)") == \
        "refused-with-one-line-saying-why-and-nothing-changed"


#: a repository path named in prose (tests/..., scripts/..., ...), with an optional ``::name``
#: inside it; a path that runs into a placeholder or a glob ({..}, <..>, *) is a pattern, not a file
REPO_PATH = re.compile(r"(?<![\w/.])((?:tests|scripts|src|conf|benchmarks|triton_kernels)/[\w./-]+)(::\w+)?(.?)")
#: named by the docs though not in the tree (none)
NOT_IN_TREE: set[str] = set()
HAND_WRITTEN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(page):
    """A file the README or a hand-written page names as evidence (``tests/app/test_ddp.py``,
    ``tests/helpers/toy_heads.py::ToyReplicatedHead``) is in the tree, with that name inside."""
    bad = []
    for m in REPO_PATH.finditer(page.read_text()):
        path, name, after = m.group(1).rstrip(".-"), (m.group(2) or "")[2:], m.group(3)
        if after in ("{", "<", "*") or path in NOT_IN_TREE:
            continue
        if not (ROOT / path).exists():
            bad.append(path)
        elif name and not re.search(rf"^\s*(?:async def|def|class) {name}\b", (ROOT / path).read_text(), re.M):
            bad.append(f"{path}::{name}")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


def lst_train_lines(page: Path) -> list[str]:
    """The ``lst-train`` command lines of a page's bash blocks (continuation lines joined)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "lst-train" in line:
                lines.append(line.split(" # ")[0].split("lst-train", 1)[1])
    return lines


def runnable_overrides(line: str) -> list[str]:
    """A command line's overrides as one job composes them: the first value of a swept list, and
    without placeholders (``<overrides>``, ``$SLURM_JOB_ID``, ``data.num_classes=D``), Hydra's own
    keys and flags (``-m``, ``--cfg job``) or a search space (``tag(log, ...)``)."""
    import shlex  # noqa: PLC0415

    out = []
    for token in shlex.split(line):
        key, _, value = token.partition("=")
        if (token.startswith("-") or token == "job" or not value or key.startswith("hydra.")
                or re.search(r"[<$(]", token) or re.fullmatch(r"[A-Z]", value)):
            continue
        out.append(token if value.startswith(("{", "[")) else f"{key}={value.split(',')[0]}")  # a dict, a list: one value
    return out


COMMANDS = [(page, line) for page in HAND_WRITTEN for line in lst_train_lines(page)]


@pytest.mark.parametrize("page,line", COMMANDS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_every_lst_train_command_of_the_docs_composes_and_passes_the_checks_before_a_run(page, line):
    """What lst-train does with a documented command before anything heavy runs: its checks of
    the overrides, Hydra's composition (a key the configs lack is refused there) and the
    configuration's checks. A file the command names need not exist here."""
    from app_configs import cfg_of  # noqa: PLC0415

    from lst_lightning.app.checks import check_config, check_overrides  # noqa: PLC0415

    overrides = runnable_overrides(line)
    check_overrides(overrides)
    cfg = cfg_of(*overrides)
    if cfg.data.get("source") != "files":  # data.path=my.txt: a placeholder of the page
        check_config(cfg)


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


#: the names the API snippets leave to the reader, at tiny sizes
SNIPPET_NAMES = """
import torch
D, d, m = 40, 4, 6
H = torch.randn(m, d, requires_grad=True)
target_idx = torch.randint(0, D, (m, 2)); target_idx[0, 1] = -1; target_idx[1, 1] = -100
W = 0.1 * torch.randn(D, d + 1)
base_lr, schedule = 1.0, 0.5
"""


@pytest.mark.parametrize("page", ["README.md", "docs/factored_head.md"])
def test_the_head_api_snippet_runs_as_written(page):
    """README's "The API" and factored_head.md's opening snippet, given tiny D, d, H, W and
    targets with both paddings: every line runs and the body gets its dL/dH."""
    names: dict = {}
    exec(SNIPPET_NAMES, names)  # noqa: S102
    exec(python_blocks(ROOT / page)[0], names)  # noqa: S102
    assert names["H"].grad is not None and names["H"].grad.shape == (6, 4) and names["H"].grad.any()
