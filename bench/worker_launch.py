"""Shared by the benches that run a test worker under torchrun (energy_auto, energy_e2e) or
launch torchrun themselves (exit_check)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_worker(worker: str, report_name: str, env: dict[str, str], ranks: int = 4
               ) -> tuple[dict, dict[str, str], float]:
    """Run `tests/workers/<worker>` on `ranks` gloo ranks with `env` added to this process's
    environment (and this checkout first on the path): (the report it wrote to `report_name`,
    each failed scenario's error, the seconds the launch took). Exits with the worker's output
    when it wrote no report."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path, **env)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
             f"--master_port={free_port()}", str(WORKERS / worker), "--out", out],
            cwd=WORKERS, env=env, capture_output=True, text=True, check=False)
        took = time.perf_counter() - start
        report_path = Path(out) / report_name
        if not report_path.exists():
            sys.exit(f"the worker wrote no report:\n{(proc.stdout + proc.stderr)[-4000:]}")
        failures = {name: error for rank in range(ranks)
                    for name, error in json.loads((Path(out) / f"rank{rank}.json")
                                                  .read_text()).items() if error}
        return json.loads(report_path.read_text()), failures, took
