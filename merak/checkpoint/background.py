"""Saving a checkpoint in the background: the step pays for the copy of what is saved into host
memory (staging), not for writing it.

A save is staged on the training thread: the weights (gathered first under ZeRO-2/3, a
collective of the training groups), the optimizer's state and the rank's state are copied into
memory no later step can change. A writer thread then writes the files, the optimizer state on
torch.distributed.checkpoint, waits for every rank (a barrier) and, on rank 0, publishes the
checkpoint (marker, rename, rotation) exactly as a synchronous save does: a checkpoint still
appears only when complete on every rank.

The writer's collectives run on a process group of their own (gloo: everything it moves is on
the host), so they never interleave with the training thread's collectives on the job's groups,
which NCCL would not allow. At most one save is in flight: the next save, loading a checkpoint,
`save_model` and the end of training wait for it, and its error is raised there. The thread is
not a daemon: an interpreter that exits normally finishes the save first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist


class BackgroundSaves:
    """The job's writer thread for checkpoints (one save in flight at most)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None
        self.pending: str | None = None  # what is being written, for messages

    def group(self, timeout_s: float | None):
        """The writer's process group (None without a process group): a collective of every
        rank on its first call, which every rank makes at its first background save."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group

    def submit(self, label: str, write: Callable[[], None]) -> None:
        """Run `write` on the writer thread, after the save before it has finished."""
        self.wait()
        self.pending, self._error = label, None
        self._thread = threading.Thread(target=self._run, args=(write,),
                                        name="merak-checkpoint-writer", daemon=False)
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as error:  # noqa: BLE001 - raised on the training thread
            self._error = error

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published; raise its error."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        label, self.pending = self.pending, None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the background save of {label} failed: "
                               f"{type(error).__name__}: {error}") from error
