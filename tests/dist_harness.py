"""Run worker scripts under torchrun and collect per-scenario results.

Each rank of a worker writes ``rank{r}.json``: ``{scenario: error text or null}``. A scenario
passes when it passed on every rank. Workers without set-up of their own run in the session's
`WorkerPool` (test modules name theirs in ``WORKER``, see conftest.py); the rest `launch` once.
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
    output = _torchrun(worker, nproc, out_dir, timeout_s, args)
    return read_results(out_dir, nproc), output


def _torchrun(worker: str, nproc: int, out_dir: Path, timeout_s: int, args) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(WORKERS / worker), "--out", str(out_dir), *args]
    # every distributed test runs under NCCL's point-to-point rules unless told otherwise
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("MERAK_NCCL_P2P_RULES", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)  # a failed launch still reports per-scenario results
    return proc.stdout + proc.stderr


def read_results(out_dir: Path, nproc: int) -> dict[str, list[str]]:
    """scenario -> every rank's error (empty when it passed on all) from ``rank<r>.json``."""
    results: dict[str, list[str]] = {}
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            continue
        for scenario, error in json.loads(path.read_text()).items():
            results.setdefault(scenario, [])
            if error is not None:
                results[scenario].append(f"rank {rank}: {error}")
    return results


class WorkerPool:
    """One torchrun launch per world size for every pooled worker the session's tests use.

    Process start-up (Python, torch and transformers imports, the process group) costs about
    5 CPU-seconds per rank, more than most scenarios on a 2-core machine; a launch per test
    module and world size paid it a dozen times. `needed` maps a world size to the worker
    files (each with ``scenarios(world_size)``) the collected tests ask for at that size;
    `get` launches all of them at the first request for that size (`workers/run_many.py`).
    """

    def __init__(self, root: Path, needed: dict[int, list[str]], timeout_s: int = 1800):
        self.root, self.needed, self.timeout_s = root, needed, timeout_s
        self._launched: dict[int, tuple[list[str], str]] = {}

    def get(self, worker: str, world_size: int) -> tuple[dict[str, list[str]], str]:
        if world_size not in self._launched:
            workers = list(dict.fromkeys([*self.needed.get(world_size, []), worker]))
            self._launched[world_size] = launch_together(
                workers, world_size, self.root / f"pool-{world_size}", self.timeout_s)
        by_worker, output = self._launched[world_size]
        if worker not in by_worker:  # asked for by a test the collection did not see
            return launch(worker, world_size, self.root / f"{Path(worker).stem}-{world_size}")
        return by_worker[worker], output


def launch_together(workers: list[str], nproc: int, out_dir: Path, timeout_s: int = 1800,
                    ) -> tuple[dict[str, dict[str, list[str]]], str]:
    """Run several workers one after another in one launch (`workers/run_many.py`). Returns
    (worker -> its results, launcher output)."""
    output = _torchrun("run_many.py", nproc, out_dir, timeout_s, ["--workers", ",".join(workers)])
    return {w: read_results(out_dir / Path(w).stem, nproc) for w in workers}, output


def check(results: dict[str, list[str]], output: str, scenario: str) -> None:
    """Fail the calling test with every rank's error for `scenario`."""
    if scenario not in results:
        raise AssertionError(f"scenario {scenario!r} did not report (the launch crashed?)\n"
                             f"{output[-6000:]}")
    if results[scenario]:
        raise AssertionError("\n".join(results[scenario]))
