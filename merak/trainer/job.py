"""`MerakArguments`' view of the job: process index, world size and who logs and writes.

HF's `TrainingArguments` takes these from accelerate's state, which on a Merak job may not
know the processes (e.g. torchrun on CPUs without ``use_cpu``: every rank is "process 0 of 1",
so every rank logs and writes). Here they come from the torch.distributed group Merak runs on
(or, before `merak.init`, from torchrun's environment), so `should_log`, `should_save`,
`get_process_log_level()` and `main_process_first()` behave as in HF: global rank 0 logs and
writes, and goes first.
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

from merak.distributed import liveness


class JobView:
    """Mixed into `MerakArguments` ahead of `TrainingArguments`."""

    @property
    def world_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def process_index(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return int(os.environ.get("RANK", 0))

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.process_index))

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """The main process (of this node with `local`, else of the job) runs the block first;
        the others wait at a barrier, then run it (HF's meaning)."""
        if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            yield
            return
        main = (self.local_process_index if local else self.process_index) == 0
        if not main:
            with liveness.waiting(f"main_process_first's barrier ({desc}: the main process "
                                  f"goes first)"):
                dist.barrier()
        try:
            yield
        finally:
            if main:
                with liveness.waiting(f"main_process_first's barrier ({desc})"):
                    dist.barrier()
