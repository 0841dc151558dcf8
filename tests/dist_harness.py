"""Run a worker script under torchrun once per test module and collect per-scenario results.

Each rank of the worker writes ``rank{r}.json``: ``{scenario: error text or null}``. A scenario
passes when it passed on every rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(worker: str, nproc: int, out_dir: Path, timeout_s: int = 900,
           args: list[str] = ()) -> tuple[dict[str, list[str]], str]:
    """Run ``workers/<worker>`` on `nproc` ranks. Returns (scenario -> errors, launcher output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(WORKERS / worker), "--out", str(out_dir), *args]
    # every distributed test runs under NCCL's point-to-point rules unless told otherwise
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("MERAK_NCCL_P2P_RULES", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)  # a failed launch still reports per-scenario results
    output = proc.stdout + proc.stderr
    results: dict[str, list[str]] = {}
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            continue
        for scenario, error in json.loads(path.read_text()).items():
            results.setdefault(scenario, [])
            if error is not None:
                results[scenario].append(f"rank {rank}: {error}")
    return results, output


def cached_launcher(worker: str, tmp_path_factory):
    """`get(world_size)` launching `worker` once per world size (for a module-scoped fixture)."""
    cache: dict[int, tuple[dict[str, list[str]], str]] = {}

    def get(world_size: int) -> tuple[dict[str, list[str]], str]:
        if world_size not in cache:
            out_dir = tmp_path_factory.mktemp(f"{Path(worker).stem}-{world_size}")
            cache[world_size] = launch(worker, world_size, out_dir)
        return cache[world_size]

    return get


def check(results: dict[str, list[str]], output: str, scenario: str) -> None:
    """Fail the calling test with every rank's error for `scenario`."""
    if scenario not in results:
        raise AssertionError(f"scenario {scenario!r} did not report (the launch crashed?)\n"
                             f"{output[-6000:]}")
    if results[scenario]:
        raise AssertionError("\n".join(results[scenario]))
