"""Test modules with a pooled worker name it in ``WORKER`` (a file in workers/ with
``scenarios(world_size)``) and its sizes in ``WORLD_SIZES``; their tests take the `launches`
fixture, ``launches(world_size, backend) -> (results, output)``. All pooled workers of one
world size and backend run in one torchrun launch (see dist_harness.WorkerPool)."""

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_CONTRACT = Path(__file__).parent / "nccl_contract"  # (on this process's path: pyproject.toml)
_BENCH = Path(__file__).parent.parent / "bench"
# Every process of the suite (this one, torchrun's ranks, the CLIs tests start) runs
# point-to-point under NCCL's contract (tests/nccl_contract): its sitecustomize installs it
# wherever torch.distributed is imported. MERAK_TEST_BACKEND=gloo runs the suite on plain gloo.
# Workers may run a procedure a bench measures (bench/energy_turns.py), so bench/ is on their
# path as it is on this process's.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(_CONTRACT), str(_BENCH), *filter(None, [os.environ.get("PYTHONPATH")])])

import nccl_contract  # noqa: E402 - installs itself unless MERAK_TEST_BACKEND=gloo
from dist_harness import WorkerPool  # noqa: E402

_NEEDED = pytest.StashKey[dict]()
_SHARED = pytest.StashKey[Path]()  # the xdist controller's directory for its processes
_GROUPS = "groups.json"  # (in it) nodeid -> process group, written by the workers' collection


def pytest_configure(config):
    """Under pytest-xdist the controller makes one directory its processes share: the pools
    (launched once per run by whichever process asks first) and the groups its scheduler
    reads."""
    if not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no":
        config.stash[_SHARED] = Path(tempfile.mkdtemp(prefix="merak-suite-"))


def pytest_unconfigure(config):
    if _SHARED in config.stash:
        shutil.rmtree(config.stash[_SHARED], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # (an xdist hook, run by the controller per process)
    node.workerinput["merak_shared"] = str(node.config.stash[_SHARED])


def _shared_dir(config) -> Path | None:
    shared = getattr(config, "workerinput", {}).get("merak_shared")
    return Path(shared) if shared else None


def pytest_collection_modifyitems(config, items):
    """Which pooled workers the selected tests need, at which world sizes and backends (a test
    parametrized by ``backend`` names its own; the rest run on the NCCL contract), and which
    process group each test belongs to (see `pytest_xdist_make_scheduler`)."""
    needed: dict[tuple[int, str], list[str]] = {}
    groups: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        groups[item.nodeid] = _module_group(path)
        worker = getattr(item.module, "WORKER", None)
        if worker is None or "launches" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        sizes = [params["world_size"]] if "world_size" in params else item.module.WORLD_SIZES
        if len(sizes) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} takes `launches` in a module of several WORLD_SIZES "
                f"{tuple(sizes)}: parametrize it with the one it launches "
                f"(@pytest.mark.parametrize('world_size', [N]), then launches(world_size))")
        backend = params.get("backend", nccl_contract.default_backend())
        groups[item.nodeid] = f"pool-{sizes[0]}-{backend}"
        if worker not in needed.setdefault((sizes[0], backend), []):
            needed[(sizes[0], backend)].append(worker)
    config.stash[_NEEDED] = needed
    shared = _shared_dir(config)
    if shared is not None:  # every process collects the same tests: the first one writes
        target = shared / _GROUPS
        if not target.exists():
            part = shared / f"{_GROUPS}.{os.getpid()}"
            part.write_text(json.dumps(groups))
            part.replace(target)


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``scripts/test.sh`` runs ``-n 2 --dist loadscope``) the tests that
    must run in one process go to one process together: the tests of each pool (one world size
    and backend: its launch runs once and serves them all), the users of `two_ranks`, and each
    other module whole (its module-scoped fixtures are built once). Pools of different sizes
    may run in different processes at once. (xdist's own ``xdist_group`` marks do not group
    under pytest 9, whose node ids xdist cannot rename.)"""
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    shared = config.stash[_SHARED]

    class ByProcessGroup(LoadScopeScheduling):
        @functools.cached_property
        def groups(self) -> dict[str, str]:  # (read once every process has collected)
            return json.loads((shared / _GROUPS).read_text())

        def _split_scope(self, nodeid: str) -> str:
            return self.groups.get(nodeid) or _module_group(nodeid.split("::", 1)[0])

    return ByProcessGroup(config, log)


@functools.cache
def _module_group(path: str) -> str:
    """The process group of a test file's tests that take no pool (a path relative to the
    repository)."""
    return "two-ranks" if Path(path).name in ("test_trainer.py", "test_trainer_fields.py") \
        else path


@pytest.fixture(scope="session")
def worker_pool(request, tmp_path_factory):
    """The session's pools: under xdist in the directory its processes share (each pool is
    launched once per run, by the first process that asks)."""
    shared = _shared_dir(request.config)
    root = shared / "pools" if shared is not None else tmp_path_factory.mktemp("pool")
    return WorkerPool(root, request.config.stash.get(_NEEDED, {}))


@pytest.fixture(scope="module")
def launches(request, worker_pool):
    """``launches(world_size, backend=None) -> (results, output)`` of the module's pooled
    worker (backend None: the suite's)."""
    worker = request.module.WORKER
    return lambda world_size, backend=None: worker_pool.get(worker, world_size, backend)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """MerakTrainer's one 2-rank launch (dp1 x tp1 x pp2; tp2 for neftune): trainer_fp16.py's
    scenarios, for test_trainer and test_trainer_fields. Returns (out dir, results, output)."""
    from dist_harness import launch

    out = tmp_path_factory.mktemp("two-ranks")
    os.environ["MERAK_TRAINER_OUT"] = str(out)
    try:
        return (out, *launch("trainer_fp16.py", 2, out / "ranks"))
    finally:
        del os.environ["MERAK_TRAINER_OUT"]
