"""Helpers of tests/test_clock_watchdog.py: a fake clock reset for the watchdog and a fake
trainer that locks (fake) clocks and waits to be signalled or killed.

The fake trainer loads `merak/energy/profiling/clock_guard.py` by file path: the guard imports the
standard library only, and importing it as ``merak.energy.profiling.clock_guard`` would run the
`merak` package's ``__init__`` (torch: seconds per process on a CPU machine).

Run as ``python clock_helpers.py MARKER_DIR [--previous] [--hold]``: it prints ``{"watchdog":
pid, "holder": pid or null}`` once the device is locked, then sleeps until a signal ends it
(exit status 3 after 30 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "MERAK_TEST_CLOCK_MARKER"  # where `write_marker` writes
DEVICE = "GPU-fake-0"


def write_marker(devices: list[str]) -> None:
    """The watchdog's fake reset: write the devices it was asked to reset, and whether torch or
    merak was imported in the watchdog, to the file named by $MERAK_TEST_CLOCK_MARKER."""
    path = Path(os.environ[MARKER])
    record = {"devices": devices, "torch": "torch" in sys.modules,
              "merak": "merak" in sys.modules}
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").replace(path)  # whole, or not there at all


def load_guard():
    """`merak/energy/profiling/clock_guard.py` as a module of its own (no `merak` package
    import)."""
    spec = importlib.util.spec_from_file_location(
        "clock_guard", ROOT / "merak" / "energy" / "profiling" / "clock_guard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_until_read(fd: int, timeout: float = 5.0) -> None:
    """Wait until the watchdog has read the pipe `fd` writes to: it is then in its loop (its
    parent's death is no longer caught by its start-up check alone)."""
    import fcntl
    import termios

    deadline = time.monotonic() + timeout
    unread = bytearray(4)
    while time.monotonic() < deadline:
        fcntl.ioctl(fd, termios.FIONREAD, unread)
        if int.from_bytes(unread, sys.byteorder) == 0:
            return
        time.sleep(0.01)
    raise TimeoutError("the watchdog did not read its pipe")


def fake_trainer(marker_dir: Path, previous: bool, hold: bool) -> int:
    """Lock the fake device's clocks under a guard whose watchdog resets with `write_marker`,
    then wait for a signal. The in-process reset writes ``trainer`` in `marker_dir`; with
    `previous`, a SIGTERM handler installed first writes ``previous`` and exits with 7; with
    `hold`, a forked child keeps the watchdog's pipe open (no end of file when this one dies)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT: no core file
    os.environ[MARKER] = str(marker_dir / "watchdog")
    if previous:
        def handler(signum, frame):
            (marker_dir / "previous").write_text(str(signum))
            sys.exit(7)

        signal.signal(signal.SIGTERM, handler)
    clock_guard = load_guard()
    guard = clock_guard.ClockGuard(clock_guard.Watchdog(reset="clock_helpers:write_marker"))

    def reset() -> None:
        (marker_dir / "trainer").write_text(DEVICE)
        guard.released(DEVICE)

    guard.locking(DEVICE, reset)
    wait_until_read(guard.watchdog.process.stdin.fileno())
    holder = os.fork() if hold else None  # like a data loader worker: it keeps the pipe open
    if holder == 0:
        time.sleep(30)
        os._exit(0)
    print(json.dumps({"watchdog": guard.watchdog.process.pid, "holder": holder}), flush=True)
    time.sleep(30)
    return 3


if __name__ == "__main__":
    sys.exit(fake_trainer(Path(sys.argv[1]), "--previous" in sys.argv[2:],
                          "--hold" in sys.argv[2:]))
