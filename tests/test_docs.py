"""The documentation (issue 35): a short README that links every page of docs/, a module table
that names every package and module of `merak`, and relative links that resolve.

Reads files only (no torch, no merak import), so it runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MODULES = DOCS / "modules.md"

README_MAX_LINES = 150
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"`(merak/(?:[\w.]+/)*(?:[\w.]+\.py)?)`")


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def markdown_files() -> list[Path]:
    return [README, *doc_pages()]


def prose(text: str) -> str:
    """The text outside fenced code blocks (their lines blanked, so line numbers stay)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link syntax reduced to its text, lower case, everything but
    letters, digits, ``_``, ``-`` and spaces dropped (backticks too), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES} and move the "
        "detail to a page of docs/")


def test_readme_links_every_docs_page():
    assert doc_pages(), "docs/ has no pages"
    linked = set()
    for target in links(README):
        file_part = target.split("#", 1)[0]
        if file_part and "://" not in file_part:
            linked.add((ROOT / file_part).resolve())
    missing = [p.relative_to(ROOT).as_posix() for p in doc_pages() if p.resolve() not in linked]
    assert not missing, f"README.md does not link these docs pages: {missing}"


def merak_tree() -> tuple[set[str], set[str]]:
    """(packages, modules) of merak/, as paths from the repository root: a package is a
    directory with an ``__init__.py`` (``merak/runtime/``), a module any other ``.py`` file
    but ``__main__.py`` (``merak/runtime/p2p.py``)."""
    packages, modules = set(), set()
    for path in (ROOT / "merak").rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            packages.add(rel[: -len("__init__.py")])
        elif path.name != "__main__.py":
            modules.add(rel)
    return packages, modules


def test_module_table_lists_every_package_and_module():
    listed = set(PATH.findall(MODULES.read_text(encoding="utf-8")))
    packages, modules = merak_tree()
    missing = sorted((packages | modules) - listed)
    stale = sorted(p for p in listed if not (ROOT / p).exists()
                   or (p.endswith("/") and not (ROOT / p).is_dir()))
    assert not missing and not stale, (
        "docs/modules.md is out of date with merak/:\n"
        f"  not listed (add a row): {missing}\n"
        f"  listed but not in the tree (moved or removed?): {stale}")


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page.resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
