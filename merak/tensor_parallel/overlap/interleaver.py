"""Stackful coroutines on threads, for level 2 of sub-pipelined TP
(`merak.tensor_parallel.overlap.levels`).

A level-2 block runs its own, unchanged forward once per sub-batch, and each sub-batch must
suspend deep inside the model's attention or MLP code (in a row-parallel layer, right after
starting its all-reduce) so that the next sub-batch can compute meanwhile. Python's standard
library has no stackful coroutines, so each sub-batch but the first runs on a helper thread and
exactly one of them runs at a time: a baton (one semaphore per sub-batch) passes at each yield
(`Interleaver.switch`) to the next unfinished sub-batch, round robin. Collectives, random draws
and autograd nodes are therefore issued in the same order on every rank, run after run, and no
two threads ever touch torch state at once.

The helper threads start with the caller's thread-local torch state re-entered: grad mode,
inference mode, autocast and, on CUDA, the current device and stream. An exception in one
sub-batch unwinds the others at their next yield and is re-raised by the calling thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch


class _Aborted(Exception):
    """Unwinds a sub-batch when another one failed."""


@dataclass
class _Run:
    """One block call: participant 0 is the calling thread, the others helper threads."""

    size: int
    turns: list[threading.Semaphore] = field(init=False)
    finished: list[bool] = field(init=False)
    results: list = field(init=False)
    error: BaseException | None = None
    done: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    def __post_init__(self) -> None:
        self.turns = [threading.Semaphore(0) for _ in range(self.size)]
        self.finished, self.results = [False] * self.size, [None] * self.size

    def _next(self, i: int) -> int | None:
        following = ((i + k) % self.size for k in range(1, self.size + 1))
        return next((j for j in following if not self.finished[j]), None)

    def switch(self, i: int) -> None:
        """Hand the baton to the next unfinished participant and wait for it to come back."""
        j = self._next(i)
        if j != i:
            self.turns[j].release()
            self.turns[i].acquire()
        if self.error is not None:
            raise _Aborted

    def finish(self, i: int) -> None:
        """Participant `i` is done: the baton goes to the next unfinished one, or the caller."""
        self.finished[i] = True
        j = self._next(i)
        (self.done if j is None else self.turns[j]).release()


@dataclass(frozen=True)
class _CallerState:
    """Thread-local torch state of the calling thread, re-entered in the helper threads."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]
    cuda_stream: torch.cuda.Stream | None

    @classmethod
    def capture(cls, device: torch.device) -> _CallerState:
        types = {"cpu", "cuda", device.type}
        autocast = tuple((t, torch.get_autocast_dtype(t)) for t in sorted(types)
                         if torch.is_autocast_enabled(t))
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, stream)

    def enter(self, stack: ExitStack) -> None:
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        if self.cuda_stream is not None:  # the current device is thread-local too
            stack.enter_context(torch.cuda.device(self.cuda_stream.device))
            stack.enter_context(torch.cuda.stream(self.cuda_stream))


class Interleaver:
    """Runs the sub-batches of one block's call as coroutines, one at a time; `switch` is their
    yield point. One per block (a thread knows which run it belongs to through it)."""

    def __init__(self) -> None:
        self._local = threading.local()  # (run, participant) of this thread, during a run

    def running(self) -> bool:
        """True on a thread that is running one of this interleaver's sub-batches."""
        return getattr(self._local, "place", None) is not None

    def switch(self) -> None:
        """Let the next sub-batch run until it yields or finishes (outside a run: nothing)."""
        place = getattr(self._local, "place", None)
        if place is not None:
            place[0].switch(place[1])

    def run(self, fn: Callable, calls: list[tuple[tuple, dict]], device: torch.device) -> list:
        """``[fn(*args, **kwargs) for args, kwargs in calls]``, interleaved at each `switch`: the
        first call on this thread, the others on helper threads.

        Raises:
            BaseException: the first error raised by any of the calls.
        """
        run, state = _Run(len(calls)), _CallerState.capture(device)
        threads = [threading.Thread(target=self._participate, args=(run, i, fn, calls[i], state),
                                    name=f"merak-tp-overlap-{i}", daemon=True)
                   for i in range(1, len(calls))]
        for thread in threads:
            thread.start()
        run.turns[0].release()
        self._participate(run, 0, fn, calls[0], None)
        run.done.acquire()
        for thread in threads:
            thread.join()
        if run.error is not None:
            raise run.error
        return run.results

    def _participate(self, run: _Run, i: int, fn: Callable, call: tuple[tuple, dict],
                     state: _CallerState | None) -> None:
        run.turns[i].acquire()
        self._local.place = (run, i)
        try:
            if run.error is None:
                with ExitStack() as stack:
                    if state is not None:
                        state.enter(stack)
                    run.results[i] = fn(*call[0], **call[1])
        except _Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 - re-raised by the calling thread
            if run.error is None:
                run.error = error
        finally:
            self._local.place = None
            run.finish(i)
