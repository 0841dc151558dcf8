"""Locked GPU clocks are reset however the process that locked them ends: a normal exit, SIGTERM,
SIGABRT (handlers that then let the signal end the process as it would have), and SIGKILL (the
watchdog process, merak/energy/profiling/clock_watchdog.py). On CPU: the resets are fakes that write
files (tests/clock_helpers.py), the watchdog runs for real in a process of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from clock_helpers import DEVICE, MARKER, load_guard

from merak.energy.profiling import clock_guard, clock_watchdog

TESTS = Path(__file__).resolve().parent
WAIT_S = 5.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="signals and the parent-death signal are Linux's")


def env_with_tests() -> dict[str, str]:
    """The environment with tests/ on PYTHONPATH (the watchdog imports clock_helpers)."""
    path = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path}


def wait_for(condition, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie no reaper collected counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def start_trainer(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, dict]:
    """The fake trainer of clock_helpers, once it has locked its device: (process, its line:
    the watchdog's pid, and the pid of the child holding the pipe with ``--hold``)."""
    trainer = subprocess.Popen([sys.executable, str(TESTS / "clock_helpers.py"), str(tmp_path),
                                *flags], stdout=subprocess.PIPE, env=env_with_tests(),
                               text=True)
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(trainer.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(WAIT_S)
    if not ready or not ready[0]:
        trainer.kill()
        pytest.fail(f"the fake trainer did not lock its clocks (exit status {trainer.wait()})")
    return trainer, json.loads(ready[0])


def test_sigkill_leaves_the_reset_to_the_watchdog(tmp_path):
    trainer, pids = start_trainer(tmp_path)
    trainer.send_signal(signal.SIGKILL)
    assert trainer.wait(WAIT_S) == -signal.SIGKILL
    marker = tmp_path / "watchdog"
    assert wait_for(marker.exists), "the watchdog did not reset the clocks"
    assert json.loads(marker.read_text()) == {"devices": [DEVICE], "torch": False,
                                              "merak": False}
    assert wait_for(lambda: gone(pids["watchdog"]))
    assert not (tmp_path / "trainer").exists()


def test_sigkill_with_the_pipe_held_open_elsewhere(tmp_path):
    """A forked child (a data loader worker) keeps the pipe open: no end of file, the parent's
    death signal (or the pid check) still brings the watchdog to reset."""
    trainer, pids = start_trainer(tmp_path, "--hold")
    try:
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(WAIT_S) == -signal.SIGKILL
        assert wait_for((tmp_path / "watchdog").exists), "the watchdog did not reset the clocks"
        assert not gone(pids["holder"])  # the pipe was still open
    finally:
        os.kill(pids["holder"], signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGABRT], ids=["sigterm", "sigabrt"])
def test_signal_resets_then_ends_the_process_by_that_signal(tmp_path, signum):
    trainer, pids = start_trainer(tmp_path)
    trainer.send_signal(signum)
    assert trainer.wait(WAIT_S) == -signum  # the exit status the signal gives without us
    assert (tmp_path / "trainer").read_text() == DEVICE
    assert wait_for(lambda: gone(pids["watchdog"])), "the watchdog did not exit with its parent"
    assert not (tmp_path / "watchdog").exists()  # told the clocks were reset: nothing to do


def test_sigterm_chains_to_the_previous_handler(tmp_path):
    trainer, pids = start_trainer(tmp_path, "--previous")
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(WAIT_S) == 7  # the previous handler's sys.exit(7)
    assert (tmp_path / "trainer").read_text() == DEVICE
    assert (tmp_path / "previous").read_text() == str(int(signal.SIGTERM))
    assert wait_for(lambda: gone(pids["watchdog"]))
    assert not (tmp_path / "watchdog").exists()


def test_watchdog_resets_what_is_locked_at_end_of_input(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", env_with_tests()["PYTHONPATH"])
    marker = tmp_path / "watchdog"
    monkeypatch.setenv(MARKER, str(marker))
    watchdog = clock_guard.Watchdog(reset="clock_helpers:write_marker")
    assert watchdog.start() and not watchdog.start()  # once
    for verb, device in [("lock", "GPU-a"), ("lock", "GPU-b"), ("unlock", "GPU-a")]:
        watchdog.tell(verb, device)
    assert watchdog.stop() == 0
    assert json.loads(marker.read_text())["devices"] == ["GPU-b"]

    marker.unlink()
    watchdog = clock_guard.Watchdog(reset="clock_helpers:write_marker")
    watchdog.start()
    watchdog.tell("lock", "GPU-a")
    watchdog.tell("unlock", "GPU-a")
    assert watchdog.stop() == 0 and not marker.exists()  # nothing left locked


def test_watchdog_names_its_own_reset_without_the_package():
    assert clock_guard.NVML_RESET == clock_watchdog.NVML_RESET
    assert clock_watchdog.resolve(clock_watchdog.NVML_RESET) is clock_watchdog.reset_nvml
    with pytest.raises(ValueError, match="module:function"):
        clock_watchdog.resolve("no_colon")
    locked = clock_watchdog.Locked()
    locked.feed(b"lock GPU-a\nlock GPU-")
    assert locked.devices == {"GPU-a"}
    locked.feed(b"b\nunlock GPU-a\n")
    assert locked.devices == {"GPU-b"}
    assert clock_guard.WATCHDOG == Path(clock_watchdog.__file__)
    guard = load_guard()  # the fake trainer's way: the same constants
    assert guard.NVML_RESET == clock_guard.NVML_RESET and guard.WATCHDOG == clock_guard.WATCHDOG


class RecordingWatchdog:
    def __init__(self):
        self.told: list[tuple[str, str]] = []
        self.started = 0

    def start(self) -> bool:
        self.started += 1
        return self.started == 1

    def tell(self, verb: str, device: str) -> None:
        self.told.append((verb, device))


def test_guard_installs_handlers_only_while_locked(monkeypatch):
    """Handlers go in with the first lock (main thread only), out with the last reset; the
    watchdog hears of each lock before it happens and each reset after. With faulthandler on
    (pytest's default), SIGABRT stays faulthandler's."""
    import atexit
    import faulthandler

    exits = []
    monkeypatch.setattr(atexit, "register", exits.append)
    previous = {s: signal.getsignal(s) for s in clock_guard.SIGNALS}
    watchdog = RecordingWatchdog()
    guard = clock_guard.ClockGuard(watchdog)
    resets = []
    try:
        worker = threading.Thread(target=guard.locking, args=("GPU-a", lambda: resets.append(1)))
        worker.start()
        worker.join()
        assert {s: signal.getsignal(s) for s in guard.signals} == previous  # not from a thread
        guard.locking("GPU-b", lambda: resets.append(2))
        ours = [s for s in guard.signals if s != signal.SIGABRT or not faulthandler.is_enabled()]
        assert ours and all(signal.getsignal(s) == guard._handle for s in ours)
        assert {s: signal.getsignal(s) for s in guard.signals if s not in ours} == {
            s: previous[s] for s in guard.signals if s not in ours}
        assert exits == [guard.reset_all] and guard.locked == ["GPU-a", "GPU-b"]
        guard.released("GPU-a")
        assert all(signal.getsignal(s) == guard._handle for s in ours)
        guard.reset_all()  # what atexit does
        assert resets == [2] and guard.locked == []
        assert {s: signal.getsignal(s) for s in guard.signals} == previous
        assert watchdog.told == [("lock", "GPU-a"), ("lock", "GPU-b"), ("unlock", "GPU-a"),
                                 ("unlock", "GPU-b")]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_nvml_gpu_tells_its_guard():
    """NVMLGPU tells the guard once per locked period: before the first lock, after the reset."""
    from merak.energy.profiling.gpu import NVMLGPU

    calls = []
    nvml = SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByUUID=lambda u: u,
        nvmlDeviceGetSupportedMemoryClocks=lambda h: [1215],
        nvmlDeviceGetSupportedGraphicsClocks=lambda h, mem: [1410, 900],
        nvmlDeviceSetGpuLockedClocks=lambda h, lo, hi: calls.append(("lock", lo)),
        nvmlDeviceResetGpuLockedClocks=lambda h: calls.append(("reset",)))
    guard = SimpleNamespace(locking=lambda device, reset: calls.append(("locking", device)),
                            released=lambda device: calls.append(("released", device)))
    gpu = NVMLGPU("GPU-1", nvml=nvml, control=False, guard=guard)
    gpu.set_clock(1410)
    gpu.set_clock(900)
    gpu.reset_clock()
    gpu.reset_clock()  # unlocked already: nothing to tell
    gpu.set_clock(900)
    assert calls == [("locking", "GPU-1"), ("lock", 1410), ("lock", 900), ("reset",),
                     ("released", "GPU-1"), ("reset",), ("locking", "GPU-1"), ("lock", 900)]
