"""Test modules with a pooled worker name it in ``WORKER`` (a file in workers/ with
``scenarios(world_size)``) and its sizes in ``WORLD_SIZES``; their tests take the `launches`
fixture, ``launches(world_size) -> (results, output)``. All pooled workers of one world size
run in one torchrun launch (see dist_harness.WorkerPool)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "workers"))

from dist_harness import WorkerPool

_NEEDED = pytest.StashKey[dict]()


def pytest_collection_modifyitems(config, items):
    """Which pooled workers the selected tests need, at which world sizes."""
    needed: dict[int, list[str]] = {}
    for item in items:
        worker = getattr(item.module, "WORKER", None)
        if worker is None or "launches" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        sizes = [params["world_size"]] if "world_size" in params else item.module.WORLD_SIZES
        for size in sizes:
            if worker not in needed.setdefault(size, []):
                needed[size].append(worker)
    config.stash[_NEEDED] = needed


@pytest.fixture(scope="session")
def worker_pool(request, tmp_path_factory):
    return WorkerPool(tmp_path_factory.mktemp("pool"), request.config.stash.get(_NEEDED, {}))


@pytest.fixture(scope="module")
def launches(request, worker_pool):
    worker = request.module.WORKER
    return lambda world_size: worker_pool.get(worker, world_size)
