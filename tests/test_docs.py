"""The docs name real files: every repository path written in backticks in README.md, DEVELOPERS.md and
docs/*.md exists (a moved or renamed module makes this fail until the docs follow it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
# the repository's own top-level folders: a backticked path starting with one of them names a file here
# (the package maps them to contextkit.<folder>; `contextkit/...` is the core package itself)
ROOTS = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "shared")
PATH = re.compile(r"`((?:" + "|".join(map(re.escape, ROOTS)) + r")/[\w./-]*[\w/])`")


def _named(doc: Path) -> list[str]:
    out = []
    for found in PATH.findall(doc.read_text()):
        if any(c in found for c in "*<>{}") or found.startswith("bench-results/"):
            continue  # a pattern or a placeholder, not a path
        out.append(found.split("::")[0])
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_a_doc_names_exists(doc):
    missing = [p for p in _named(doc) if not (REPO / p).exists()]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_check_reads_paths_at_all():
    assert "integrations/proxy/routes.py" in _named(REPO / "docs" / "security.md")
