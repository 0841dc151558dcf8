"""Run worker scripts under torchrun and collect per-scenario results.

Each rank of a worker writes ``rank{r}.json``: ``{scenario: {"error": traceback or null,
"figures": what the scenario returned or null}}`` (workers/common.py). A scenario that checks
itself raises; a parity scenario returns its figures (measured values next to the reference's,
`Compared`), which the test body compares with its own tolerances: `scenario_result` gives each
rank's figures, `assert_like_reference` compares their pairs. Workers without set-up of their
own run in the session's `WorkerPool` (test modules name theirs in ``WORKER``, see
conftest.py); the rest `launch` once.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import nccl_contract  # tests/nccl_contract: on sys.path (pyproject.toml), PYTHONPATH (conftest)

WORKERS = Path(__file__).parent / "workers"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(worker: str, nproc: int, out_dir: Path, timeout_s: int = 900,
           args: list[str] = (), backend: str | None = None) -> tuple[dict[str, list[str]], str]:
    """Run ``workers/<worker>`` on `nproc` ranks. Returns (scenario -> errors, launcher output).

    `backend`: "nccl-contract" (the suite's default: gloo presenting NCCL's point-to-point
    contract, tests/nccl_contract) or "gloo" (plain gloo, as CPU users run it)."""
    output = _torchrun(worker, nproc, out_dir, timeout_s, args, backend)
    return read_results(out_dir, nproc), output


def _torchrun(worker: str, nproc: int, out_dir: Path, timeout_s: int, args,
              backend: str | None = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", str(WORKERS / worker), "--out", str(out_dir), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if backend is not None:
        env[nccl_contract.ENV] = backend
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)  # a failed launch still reports per-scenario results
    return proc.stdout + proc.stderr


class Results(dict):
    """scenario -> every rank's error (empty when it passed on all); ``figures[scenario]``: each
    rank's figures, by rank (None where that rank did not report the scenario)."""

    def __init__(self, nproc: int):
        super().__init__()
        self.nproc, self.figures = nproc, {}


def read_results(out_dir: Path, nproc: int) -> Results:
    """Every rank's ``rank<r>.json`` (see the module's docstring)."""
    results = Results(nproc)
    for rank in range(nproc):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            continue
        for scenario, record in json.loads(path.read_text()).items():
            results.setdefault(scenario, [])
            results.figures.setdefault(scenario, [None] * nproc)[rank] = record["figures"] or {}
            if record["error"] is not None:
                results[scenario].append(f"rank {rank}: {record['error']}")
    return results


class WorkerPool:
    """One torchrun launch per world size and backend for every pooled worker the session's
    tests use.

    Process start-up (Python, torch and transformers imports, the process group) costs about
    5 CPU-seconds per rank, more than most scenarios on a 2-core machine; a launch per test
    module and world size paid it a dozen times. `needed` maps (world size, backend) to the
    worker files (each with ``scenarios(world_size)``) the collected tests ask for; `get`
    launches all of them at the first request for that pair (`workers/run_many.py`). The
    backend is "nccl-contract" (every test's default) or "gloo" (plain gloo). A launch may take
    `timeout_s`: with the 2- and 4-rank pools side by side on 2 cores, a busy machine took 28
    minutes for the 4-rank one.

    `root` may be shared by the suite's processes (pytest-xdist): a launch runs under a file
    lock and leaves ``launched.json`` (its output) beside its results, so a process asking for
    a pool another one launched waits for it and reads its results instead of launching again.
    """

    def __init__(self, root: Path, needed: dict[tuple[int, str], list[str]],
                 timeout_s: int = 2700):
        self.root, self.needed, self.timeout_s = root, needed, timeout_s
        self._launched: dict[tuple[int, str], tuple[dict, str]] = {}

    def _dir(self, world_size: int, backend: str | None) -> Path:
        return self.root / f"pool-{world_size}-{backend or nccl_contract.default_backend()}"

    def get(self, worker: str, world_size: int, backend: str | None = None,
            ) -> tuple[dict[str, list[str]], str]:
        """`backend` None: the suite's (`nccl_contract.default_backend`)."""
        backend = backend or nccl_contract.default_backend()
        key = (world_size, backend)
        if key not in self._launched:
            self._launched[key] = self._launch_once(world_size, backend, worker)
        by_worker, output = self._launched[key]
        if worker not in by_worker:  # asked for by a test the collection did not see
            return launch(worker, world_size, self.root / f"{Path(worker).stem}-{world_size}",
                          backend=backend)
        return by_worker[worker], output

    def _launch_once(self, world_size: int, backend: str, worker: str,
                     ) -> tuple[dict[str, dict[str, list[str]]], str]:
        workers = list(dict.fromkeys([*self.needed.get((world_size, backend), []), worker]))
        out_dir = self._dir(world_size, backend)
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held by the launching process until it is done
            done = out_dir / "launched.json"
            if done.exists():
                record = json.loads(done.read_text())
                return ({w: read_results(out_dir / Path(w).stem, world_size)
                         for w in record["workers"]}, record["output"])
            found = launch_together(workers, world_size, out_dir, self.timeout_s, backend)
            done.write_text(json.dumps({"workers": workers, "output": found[1]}))
            return found

    def out_dir(self, worker: str, world_size: int, backend: str | None = None) -> Path:
        """Where `worker`'s scenarios wrote their files (`common.out_dir()`) in that launch."""
        return self._dir(world_size, backend) / Path(worker).stem


def launch_together(workers: list[str], nproc: int, out_dir: Path, timeout_s: int = 1800,
                    backend: str | None = None) -> tuple[dict[str, dict[str, list[str]]], str]:
    """Run several workers one after another in one launch (`workers/run_many.py`). Returns
    (worker -> its results, launcher output). MERAK_TEST_ONLY=a,b: only those scenarios run
    (with ``-k`` on their tests, to rerun a few without their whole launch)."""
    only = os.environ.get("MERAK_TEST_ONLY")
    output = _torchrun("run_many.py", nproc, out_dir, timeout_s,
                       ["--workers", ",".join(workers), *(["--only", only] if only else [])],
                       backend)
    return {w: read_results(out_dir / Path(w).stem, nproc) for w in workers}, output


def check(results: dict[str, list[str]], output: str, scenario: str) -> None:
    """Fail the calling test with every rank's error for `scenario`."""
    if scenario not in results:
        raise AssertionError(f"scenario {scenario!r} did not report (the launch crashed?)\n"
                             f"{output[-6000:]}")
    if results[scenario]:
        raise AssertionError("\n".join(results[scenario]))


def scenario_result(results: Results, output: str, scenario: str) -> list[dict]:
    """Each rank's figures for `scenario` (``{}`` where it returned none); fails the calling
    test with every rank's error when the scenario raised, or a rank did not report it."""
    check(results, output, scenario)
    figures = results.figures[scenario]
    missing = [rank for rank, f in enumerate(figures) if f is None]
    if missing:
        raise AssertionError(f"scenario {scenario!r}: rank(s) {missing} did not report\n"
                             f"{output[-6000:]}")
    return figures


def assert_like_reference(figures: list[dict], *, rtol: float, atol: float,
                          grad_atol_of_max: float) -> int:
    """Every pair each rank's figures hold (workers/common.py `Compared`) is close: floats and
    value tensors by ``torch.testing.assert_close(actual, expected, rtol, atol)`` (floats as
    float32 tensors), gradients with atol raised by `grad_atol_of_max` times the reference's
    largest entry (entries that nearly cancel carry the rounding of much larger terms, which
    differs with the order of sums). Returns the number of pairs compared."""
    import torch

    compared = 0
    for rank, ranks_figures in enumerate(figures):
        pairs = [("value", what, torch.tensor(a), torch.tensor(e))
                 for what, (a, e) in ranks_figures.get("floats", {}).items()]
        if ranks_figures.get("tensors"):
            saved = torch.load(ranks_figures["tensors"])
            pairs += [(kind, what, a, e) for kind in ("value", "grad")
                      for what, (a, e) in saved[kind].items()]
        for kind, what, actual, expected in pairs:
            bound = atol + (grad_atol_of_max * expected.abs().max().item()
                            if kind == "grad" and expected.numel() else 0.0)
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=bound,
                                       msg=lambda m, w=what, r=rank: f"rank {r}: {w}: {m}")
            compared += 1
    return compared
