"""The docs, the scripts' help, the code's comments and the configs describe the software as it
is: no issue numbers, no dated "now", no "before commit" or "fixed later", and nothing about how
the work was organised. The changelog is the one place for what changed."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "results" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = [p for part in ("src", "scripts", "conf", "tests", "triton_kernels") for p in sorted((ROOT / part).rglob("*"))
           if p.suffix in (".py", ".yaml", ".md") and p.resolve() != Path(__file__).resolve()]

# what reads as history anywhere
HISTORY = re.compile(
    r"\bissue (?:#\s*)?\d+|\bbefore (?:commit|the change|the fix)\b|\bfixed later\b"
    # a dated "now": what changed, not what the code does at this point of its flow
    r"|\bnow (?:compiles|supports|uses|runs|takes|resumes|counts|has|does|gives|defaults|works|refuses|picks)\b"
    r"|\b(?:is|are|was|has|have|does|do|counts?) now\b|\bcounts? [\d.]+ now\b"
    # how the work was organised
    r"|\bsessions? (?:of|with|helper)|\b(?:in|a|this|each|the) session\b|\bengineers?\b|\bthe lead\b"
    r"|\bhelper (?:session|engineer|agent)s?\b|\bsub-?agents?\b|\bhand-?offs?\b|\bbriefs?\b",
    re.I)
# in the docs' prose "now" is always dated, but where it names the moment of a step
DOCS_NOW = re.compile(r"\bnow\b", re.I)
DOCS_NOW_ALLOWED = ("read now",)


def hits(path: Path, pattern: re.Pattern, allowed: tuple[str, ...] = ()) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    text = re.sub(r"\$\{now:[^}]*\}|datetime\.\w*\.?now\(\)", "", text)  # Hydra's and Python's clocks
    return [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
            for m in pattern.finditer(text)
            if not any(a in text[max(0, m.start() - 20):m.end() + 20].lower() for a in allowed)]


def test_no_history_in_docs_help_comments_or_configs():
    found = [h for p in DOCS + SOURCES for h in hits(p, HISTORY)]
    assert not found, "history where the software should be described as it is:\n" + "\n".join(found)


def test_no_dated_now_in_the_docs():
    found = [h for p in DOCS for h in hits(p, DOCS_NOW, DOCS_NOW_ALLOWED)]
    assert not found, "a dated 'now' in the docs:\n" + "\n".join(found)
