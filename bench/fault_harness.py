"""Launch a job of `fault_worker.py` (beside this file) with one rank stopped or killed, and
time every rank's exit from the moment of the fault (tests/test_faults.py, bench/fault_sweep.py).

The ranks are started here, as torchrun's agent starts them (the TCPStore lives in this process,
``TORCHELASTIC_USE_AGENT_STORE``), but nothing stops the survivors when a rank dies (torchrun
would, within its 0.1 s monitor interval): what ends them is Merak's own timeout and the error
it raises. The stopped rank is killed at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

WORKER = Path(__file__).parent / "fault_worker.py"


@dataclass
class Outcome:
    fault: dict | None  # what the faulty rank wrote when it injected the fault
    exit_after_s: dict[int, float] = field(default_factory=dict)  # survivor -> s after it
    codes: dict[int, int | None] = field(default_factory=dict)
    output: dict[int, str] = field(default_factory=dict)

    def named(self, rank: int, missing: int) -> bool:
        """Whether `rank`'s error names `missing` as the rank that did not arrive."""
        return bool(re.search(rf"(PeerFailureError|P2PTimeoutError): .*rank\(s\) "
                              rf"\[([^\]]*, )?{missing}(, [^\]]*)?\] did not arrive",
                              self.output.get(rank, "")))

    def summary(self) -> str:
        lines = [f"fault: {self.fault}"]
        for rank in sorted(self.codes):
            tail = [line for line in self.output.get(rank, "").splitlines()
                    if "Error" in line or "gave up" in line][-2:]
            lines.append(f"rank {rank}: exit {self.codes[rank]} after "
                         f"{self.exit_after_s.get(rank, float('nan')):.1f} s; {tail}")
        return "\n".join(lines)


def launch(out: Path, world: int, pp: int, fault: str, timeout_s: int,
           grace_s: float = 90.0, deadline_s: float = 900.0) -> Outcome:
    """Run the job (`fault` = "rank:point:step:kind") and wait until every survivor exited,
    `grace_s` after the fault, or `deadline_s` after the start (a loaded host can take minutes
    to import torch in 4 processes); the ranks still running are then killed and have no exit
    time."""
    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_RUN_ID=f"faults-{os.getpid()}-{time.monotonic_ns()}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FAULT=fault)
    procs = {}
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs[rank] = (subprocess.Popen(
            [sys.executable, str(WORKER), "--out", str(out), "--dp", str(world // pp),
             "--pp", str(pp), "--timeout", str(timeout_s)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log,
            stderr=subprocess.STDOUT), log)
    faulty = int(fault.split(":")[0])
    ended: dict[int, float] = {}
    start, fault_file, injected = time.monotonic(), out / "fault.json", None
    while time.monotonic() - start < deadline_s:
        for rank, (proc, _) in procs.items():
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
        if all(r in ended for r in procs if r != faulty):
            break
        if injected is None and fault_file.exists():
            injected = time.monotonic()
        if injected is not None and time.monotonic() - injected > grace_s:
            break
        time.sleep(0.05)
    outcome = Outcome(json.loads(fault_file.read_text()) if fault_file.exists() else None)
    for rank, (proc, log) in procs.items():
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        log.close()
        outcome.codes[rank] = proc.returncode if rank in ended else None
        outcome.output[rank] = (out / f"rank{rank}.log").read_text()
        if rank in ended and outcome.fault is not None and rank != faulty:
            outcome.exit_after_s[rank] = ended[rank] - outcome.fault["time"]
    del store
    return outcome
