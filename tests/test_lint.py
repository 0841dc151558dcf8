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


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finding_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_merak_imports_itself_back():
    """No import cycle between merak's modules, counting imports inside functions (grimp reads
    every import statement; those under ``if TYPE_CHECKING`` do not run and are left out)."""
    import grimp

    graph = grimp.build_graph("merak", exclude_type_checking_imports=True)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


BENCH = ROOT / "bench"
TEST_MODULES = {p.stem for d in ("tests", "tests/workers", "tests/nccl_contract")
                for p in (ROOT / d).glob("*.py")} | {"tests", "nccl_contract"}


def _bench_offences(source: str) -> list[str]:
    """What ties a bench to tests/ or past `build_engine`: an import of a module of tests/ (one
    bench/ has no file of its own for), a path into tests/, a `sys.path` edit, or the
    interpreter built directly (`PipelineInterpreter`)."""
    import ast

    own = {p.stem for p in BENCH.glob("*.py")}
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            found += [f"line {node.lineno}: imports PipelineInterpreter" for alias in node.names
                      if alias.name == "PipelineInterpreter"]
        for name in names:
            top = name.split(".")[0]
            if top in TEST_MODULES and top not in own:
                found.append(f"line {node.lineno}: imports {name} (tests/)")
        if isinstance(node, ast.Attribute) and node.attr == "PipelineInterpreter":
            found.append(f"line {node.lineno}: builds PipelineInterpreter (use build_engine)")
        if isinstance(node, ast.Attribute) and node.attr == "path" and \
                isinstance(node.value, ast.Name) and node.value.id == "sys":
            found.append(f"line {node.lineno}: edits sys.path")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                (node.value == "tests" or node.value.startswith("tests/")):
            found.append(f"line {node.lineno}: a path into tests/ ({node.value!r})")
    return found


def test_the_offence_finder_finds_each_offence():
    planted = ("import sys\nfrom dist_harness import launch\nimport merak\n"
               "from merak import PipelineInterpreter\nsys.path.insert(0, 'x')\n"
               "engine = merak.PipelineInterpreter()\nWORKERS = ROOT / 'tests' / 'workers'\n")
    assert len(_bench_offences(planted)) == 5, _bench_offences(planted)
    assert _bench_offences("from _common import build\nimport merak\n") == []


def test_benches_stand_alone():
    """Every bench imports nothing from tests/ and builds its engine through `build_engine`
    (bench/_common.py), so a bench runs from a checkout without the test suite."""
    offences = {p.name: found for p in sorted(BENCH.glob("*.py"))
                if (found := _bench_offences(p.read_text()))}
    assert not offences, offences
