"""The codebase's contracts, checked by the suite (and so by CI): Merak's layers
(`.importlinter`, import-linter's layers contract: a module imports only from its own
package or lower layers, see docs/modules.md) and `ruff check` (pyproject's rules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's scripts: the test extra installs both tools


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_layers_hold():
    result = _run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_layers_contract_lists_every_package_and_no_exception():
    """Every package of merak is in a layer (a new one cannot slip past the contract), and
    the contract ignores no import."""
    config = (ROOT / ".importlinter").read_text()
    assert "ignore_imports" not in config
    layers = config.split("layers =", 1)[1]
    named = {p.strip() for line in layers.splitlines() for p in line.split("|") if p.strip()}
    packages = {p.name for p in (ROOT / "merak").iterdir()
                if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "merak").glob("*.py") if p.stem != "__init__"}
    missing = (packages | modules) - named
    assert not missing, f".importlinter's layers leave out {sorted(missing)}"


def test_ruff_passes():
    result = _run(str(BIN / "ruff"), "check", "merak", "tests", "bench", "examples", "scripts")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
