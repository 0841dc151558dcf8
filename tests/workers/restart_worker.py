"""One rank of a job that torchrun restarts (``--max-restarts 1``): every attempt builds the
context (`merak.init(dp=2)`, gloo) and all-reduces rank + 1; in the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) rank 1 then kills itself (SIGKILL), so the agent restarts
both ranks. In a later attempt rank 0 comes late, so rank 1 reads the store before rank 0 wrote
its address: with the dead attempt's keys still in the agent's store it would connect to them.
Launched by tests/test_torchrun_restart.py; each rank prints its attempt and result.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import merak

TIMEOUT_S = 60  # the job's timeout: a group that cannot form fails well inside the test's bound


def main() -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if attempt > 0 and rank == 0:
        time.sleep(3.0)
    context = merak.init(dp=2, backend="gloo", timeout=TIMEOUT_S)
    total = torch.tensor([float(context.rank + 1)])
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {context.rank} all_reduce {total.item():g}", flush=True)
    if attempt == 0 and context.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 of the first attempt: fails when rank 1 dies, or torchrun ends it


if __name__ == "__main__":
    main()
