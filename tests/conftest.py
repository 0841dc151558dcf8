"""Test modules with a pooled worker name it in ``WORKER`` (a file in workers/ with
``scenarios(world_size)``) and its sizes in ``WORLD_SIZES``; their tests take the `launches`
fixture, ``launches(world_size, backend) -> (results, output)``. All pooled workers of one
world size and backend run in one torchrun launch (see dist_harness.WorkerPool)."""

import functools
import os
import re
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


def pytest_collection_modifyitems(config, items):
    """Which pooled workers the selected tests need, at which world sizes and backends (a test
    parametrized by ``backend`` names its own; the rest run on the NCCL contract)."""
    needed: dict[tuple[int, str], list[str]] = {}
    for item in items:
        worker = getattr(item.module, "WORKER", None)
        if worker is None or "launches" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        sizes = [params["world_size"]] if "world_size" in params else item.module.WORLD_SIZES
        backend = params.get("backend", nccl_contract.default_backend())
        for size in sizes:
            if worker not in needed.setdefault((size, backend), []):
                needed[(size, backend)].append(worker)
    config.stash[_NEEDED] = needed


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``scripts/test.sh`` runs ``-n 2 --dist loadscope``) the tests that
    must run in one process go to one worker together: every module with pooled tests (each
    pool is launched once, by the process that runs them), the users of `two_ranks`, and each
    other module whole (its module-scoped fixtures are built once). (xdist's own
    ``xdist_group`` marks do not group under pytest 9, whose node ids xdist cannot rename.)"""
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ByProcessGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return ByProcessGroup(config, log)


@functools.cache
def _group(path: str) -> str:
    """The worker group of a test file (a path relative to the repository)."""
    name = Path(path).name
    if name in ("test_trainer.py", "test_trainer_fields.py"):  # `two_ranks`' users
        return "two-ranks"
    text = (Path(__file__).parent.parent / path).read_text(encoding="utf-8")
    if re.search(r"^(WORKER, )?WORLD_SIZES\b", text, re.MULTILINE):  # a pooled module
        return "pooled"
    return path


@pytest.fixture(scope="session")
def worker_pool(request, tmp_path_factory):
    return WorkerPool(tmp_path_factory.mktemp("pool"), request.config.stash.get(_NEEDED, {}))


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
