"""Time work on the device it runs on: CUDA events on a CUDA device, the host clock elsewhere.

On a GPU, `time.perf_counter()` around a kernel launch measures the launch, not the kernel:
the host runs ahead of the device. `DeviceTimer` records a CUDA event (on the current stream)
at each mark and reads them all once, with one synchronisation, when asked for the intervals
(at the end of a step), so timing never stalls the pipeline between instructions. On CPU the
work is done when the call returns, and the host clock is exact.
"""

from __future__ import annotations

import time

import torch


class DeviceTimer:
    """Named intervals ``(label, start_s, end_s)`` on `device`, relative to the first mark
    since the last `reset`."""

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device or "cpu")
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self._marks: list = []  # CUDA events or host times, in recording order
        self._open: dict[object, int] = {}  # key -> index of its start mark
        self._closed: list[tuple[object, int, int]] = []  # (label, start index, end index)

    def _mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def reset(self) -> None:
        """Forget every interval; the next mark is the new origin."""
        self._marks, self._open, self._closed = [], {}, []
        self._mark()

    def begin(self, key: object) -> None:
        if not self._marks:
            self._mark()
        self._open[key] = self._mark()

    def end(self, key: object, label: object = None) -> None:
        """Close the interval opened with `key`; it is reported under `label` (default the
        key)."""
        self._closed.append((key if label is None else label, self._open.pop(key),
                             self._mark()))

    def intervals(self) -> list[tuple[object, float, float]]:
        """Every closed interval in seconds from the origin, in closing order. On CUDA this
        waits for the last recorded event (once)."""
        if not self._closed:
            return []
        if self.cuda:
            self._marks[-1].synchronize()
            origin = self._marks[0]
            seconds = [origin.elapsed_time(m) / 1e3 for m in self._marks]
        else:
            seconds = [m - self._marks[0] for m in self._marks]
        return [(label, seconds[a], seconds[b]) for label, a, b in self._closed]
