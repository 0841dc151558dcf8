"""The documentation: a short README that links every page of docs/, a module table
that names every package and module of `merak`, relative links that resolve, and a repository
that cites nothing outside itself (no files beyond it, no numbered issues).

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


OUTSIDE = re.compile(r"\.\./shared|\b(?:FINDINGS|SPEC|STYLE)\.md\b")
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg", ".ini", ".txt", ".yml", ".yaml", ""}


def repository_files() -> list[Path]:
    """The repository's own text files (what git tracks; without git: everything but build,
    environment and result folders)."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
        files = [ROOT / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "runs", "out", "build", "__pycache__"}
        files = [p for p in ROOT.rglob("*") if p.is_file()
                 and not skip.intersection(p.relative_to(ROOT).parts)]
    return [p for p in files if p.suffix in TEXT_SUFFIXES and p.is_file()]


def test_the_repository_cites_nothing_outside_itself():
    """No file refers to files outside the repository or to numbered issues (which live in a
    tracker the repository does not carry): each says what it means in its own words."""
    found = []
    for path in repository_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line) or ISSUE_NUMBER.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_every_trainer_method_merak_overrides_is_listed_with_its_module():
    """docs/trainer.md's table names each `transformers.Trainer` method a Merak mixin
    overrides, with the module that does it."""
    import transformers

    from merak import MerakTrainer

    table = (ROOT / "docs" / "trainer.md").read_text().split(
        "## What MerakTrainer changes in HF's Trainer", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip().strip("`")
            for line in table.splitlines() if line.startswith("| `")}
    overridden = {}
    for klass in MerakTrainer.__mro__:
        if klass.__module__.startswith("merak."):
            for name in vars(klass):
                if callable(getattr(transformers.Trainer, name, None)) and name != "__init__":
                    overridden.setdefault(name, klass.__module__.rsplit(".", 1)[1] + ".py")
    assert overridden and rows == overridden
