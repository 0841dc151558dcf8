"""A process that outlives the trainer and resets the GPU clocks the trainer left locked.

`merak.energy.profiling.clock_guard` starts it once per trainer process, the first time that process
locks a GPU's clocks, and keeps the write end of its stdin. It writes one line per change:
``lock <device>`` before locking the clocks of a device (an NVML UUID) and ``unlock <device>``
after resetting them. When the trainer dies, however it dies (SIGKILL, an ``abort()`` such as
the NCCL watchdog's, a segmentation fault), the kernel sends this process SIGTERM
(``PR_SET_PDEATHSIG``) and its stdin reaches end of file; it then resets every device still
locked and exits. A check of its parent's pid every `POLL_S` seconds covers systems without
``prctl`` and a parent thread (not process) that ended.

The trainer starts it as a script, by file path: it imports the standard library only (and
NVML when it resets), never torch or the `merak` package (whose ``__init__`` imports torch),
so it starts in a few tens of milliseconds. The reset is a function named ``module:function``
(`NVML_RESET` in production, which resets through NVML), called with the devices to reset;
this module's own functions are found under its package name without importing the package.

Run it as ``python clock_watchdog.py --parent PID [--reset module:function]``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import select
import signal
import sys
from collections.abc import Callable
from pathlib import Path

MODULE = "merak.energy.profiling.clock_watchdog"
NVML_RESET = f"{MODULE}:reset_nvml"
POLL_S = 1.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def reset_nvml(devices: list[str]) -> None:
    """Reset the locked SM clocks of `devices` (NVML UUIDs) through NVML.

    Merak locks the SM (graphics) clocks only, never the memory clocks, so those are left
    alone. A device that cannot be reset is reported on stderr; the others are still reset.

    Args:
        devices: NVML UUIDs (``GPU-...``) of the GPUs to reset.
    """
    import pynvml

    pynvml.nvmlInit()
    try:
        for uuid in devices:
            try:
                pynvml.nvmlDeviceResetGpuLockedClocks(pynvml.nvmlDeviceGetHandleByUUID(uuid))
            except pynvml.NVMLError as error:
                print(f"merak clock watchdog: cannot reset the clocks of {uuid}: {error}",
                      file=sys.stderr)
    finally:
        pynvml.nvmlShutdown()


def resolve(spec: str) -> Callable[[list[str]], None]:
    """The function named by `spec`, ``module:function``.

    Args:
        spec: a module's dotted name and a function's name in it, separated by a colon. This
            module's own functions are taken from the running script, so naming them does not
            import the `merak` package.

    Returns:
        The function.

    Raises:
        ValueError: `spec` has no colon.
    """
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"a reset function is named module:function, not {spec!r}")
    if module == MODULE:
        return globals()[name]
    return getattr(importlib.import_module(module), name)


def ask_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when its parent ends (Linux only).

    Args:
        signum: the signal to receive.

    Returns:
        Whether the kernel took the request.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Locked:
    """The devices whose clocks the parent has locked, as its messages tell."""

    def __init__(self) -> None:
        self.devices: set[str] = set()
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Apply the complete lines of `data` (a trailing partial line waits for the rest).

        Args:
            data: bytes read from the parent.
        """
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            verb, _, device = line.decode("utf-8", "replace").strip().partition(" ")
            if verb == "lock" and device:
                self.devices.add(device)
            elif verb == "unlock" and device:
                self.devices.discard(device)
            elif verb:
                print(f"merak clock watchdog: ignoring {line!r}", file=sys.stderr)


def drain(fd: int) -> bytes:
    """Whatever can be read from `fd` now, without waiting.

    Args:
        fd: a file descriptor (it is left non-blocking).

    Returns:
        The bytes read (empty at end of file or when nothing is waiting).
    """
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def watch(parent: int, fd: int, locked: Locked, poll_s: float = POLL_S) -> None:
    """Follow the parent's messages on `fd` until it ends (end of file, or a new parent pid).

    SIGTERM only wakes the wait (through a wake-up pipe): sent while the parent lives, it is
    not the parent's death and is ignored.

    Args:
        parent: the parent's pid.
        fd: the read end of the parent's pipe.
        locked: updated from the messages.
        poll_s: how often the parent's pid is checked without any signal.
    """
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ask_death_signal(signal.SIGTERM)
    while os.getppid() == parent:  # the parent may have died before the request
        ready, _, _ = select.select([fd, wake_r], [], [], poll_s)
        if wake_r in ready:
            drain(wake_r)
        if fd in ready:
            data = os.read(fd, 65536)
            if not data:
                return
            locked.feed(data)


def main(argv: list[str] | None = None) -> int:
    """Watch the parent, then reset the devices it left locked.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status: 0, or 1 when the reset failed.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="the trainer's pid")
    parser.add_argument("--reset", default=NVML_RESET, help="module:function")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent
    if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == here:
        del sys.path[0]  # run as a script: its siblings must not shadow other modules
    reset = resolve(args.reset)
    locked = Locked()
    fd = sys.stdin.fileno()
    watch(args.parent, fd, locked)
    locked.feed(drain(fd))  # what the parent wrote last (a line is one atomic write)
    if not locked.devices:
        return 0
    try:
        reset(sorted(locked.devices))
    except Exception as error:  # report, then exit: nothing else can be done
        print(f"merak clock watchdog: resetting {sorted(locked.devices)} failed: {error}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
