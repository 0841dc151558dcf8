"""Reset the GPU clocks this process locked, however the process ends.

`NVMLGPU` tells the process's `ClockGuard` before it locks a device's clocks (`locking`) and
after it resets them (`released`). While any device is locked, three things stand ready:

- ``atexit``: a normal exit, ``sys.exit`` and an uncaught exception reset the clocks.
- SIGTERM and SIGABRT handlers (installed from the main thread only): they reset the clocks,
  put the previous handler back and hand it the signal, or, if there was none, raise the signal
  again under the default action, so the exit status is the one the signal would have given.
  They are taken down again once nothing is locked (unless someone installed a handler since).
  With `faulthandler` enabled, SIGABRT stays its (a traceback dump matters more when NCCL
  aborts; the watchdog resets the clocks then).
- A watchdog process (`merak.energy.profiling.clock_watchdog`), started once per process, in a
  session of its own (torchrun signals its workers' process groups). It resets whatever is still
  locked when this process dies without running any of the above: SIGKILL, a crash, or an
  ``abort()`` inside the process (the NCCL watchdog's: glibc's abort ends the process before a
  Python handler can run).

Standard library only, like the watchdog; no torch.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

WATCHDOG = Path(__file__).with_name("clock_watchdog.py")
NVML_RESET = "merak.energy.profiling.clock_watchdog:reset_nvml"  # clock_watchdog.NVML_RESET
SIGNALS = (signal.SIGTERM, signal.SIGABRT)


class Watchdog:
    """The watchdog process of this process: started on demand, told of each change.

    Args:
        reset: the watchdog's reset function, ``module:function`` (NVML by default).
    """

    def __init__(self, reset: str = NVML_RESET):
        self.reset = reset
        self.process: subprocess.Popen | None = None
        self._failed = False

    def running(self) -> bool:
        """Whether the watchdog was started and has not exited."""
        return self.process is not None and self.process.poll() is None

    def start(self) -> bool:
        """Start the watchdog unless it runs (or could not be started before).

        Returns:
            Whether a watchdog was started now (it then knows of no device yet).
        """
        if self.running() or self._failed:
            return False
        try:
            self.process = subprocess.Popen(
                [sys.executable, str(WATCHDOG), "--parent", str(os.getpid()),
                 "--reset", self.reset],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as error:
            self._failed = True
            warnings.warn(f"cannot start the GPU clock watchdog ({error}): a killed process "
                          f"may leave its GPU's clocks locked", RuntimeWarning, stacklevel=3)
            return False
        return True

    def tell(self, verb: str, device: str) -> None:
        """Send ``<verb> <device>`` to the watchdog (nothing if it does not run).

        Args:
            verb: ``lock`` or ``unlock``.
            device: the device's NVML UUID.
        """
        if self.process is None or self.process.stdin is None:
            return
        try:
            self.process.stdin.write(f"{verb} {device}\n".encode())
            self.process.stdin.flush()
        except (OSError, ValueError):  # it exited (broken pipe) or was stopped
            pass

    def stop(self, timeout: float = 5.0) -> int | None:
        """Close its stdin (it resets what is still locked and exits) and wait for it.

        Args:
            timeout: seconds to wait for it.

        Returns:
            Its exit status, or None if it was not started or has not exited in time.
        """
        if self.process is None:
            return None
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class ClockGuard:
    """The devices this process locked and how to reset each, with the safety nets above.

    Args:
        watchdog: the watchdog to tell (a new `Watchdog` resetting through NVML by default).
        signals: the signals handled while a device is locked.
    """

    def __init__(self, watchdog: Watchdog | None = None,
                 signals: tuple[int, ...] = SIGNALS):
        self.watchdog = watchdog or Watchdog()
        self.signals = signals
        self.pid = os.getpid()
        self._resets: dict[str, Callable[[], None]] = {}
        self._previous: dict[int, object] = {}  # signal -> the handler ours replaced
        self._lock = threading.RLock()  # re-entered by a signal handler in the main thread
        self._at_exit = False

    @property
    def locked(self) -> list[str]:
        """The devices locked now."""
        return sorted(self._resets)

    def locking(self, device: str, reset: Callable[[], None]) -> None:
        """Call before locking the clocks of `device`.

        Args:
            device: the device's NVML UUID.
            reset: resets its clocks (it may call `released` itself).
        """
        with self._lock:
            self._resets[device] = reset
            if self.watchdog.start():
                for known in self._resets:  # a new watchdog (the first, or a restart)
                    self.watchdog.tell("lock", known)
            else:
                self.watchdog.tell("lock", device)
            if not self._at_exit:
                atexit.register(self.reset_all)
                self._at_exit = True
            self._install()

    def released(self, device: str) -> None:
        """Call after the clocks of `device` were reset.

        Args:
            device: the device's NVML UUID.
        """
        with self._lock:
            if self._resets.pop(device, None) is None:
                return
            self.watchdog.tell("unlock", device)
            if not self._resets:
                self._uninstall()

    def reset_all(self) -> None:
        """Reset every device locked now (a failure is warned about; the watchdog retries it
        when this process ends)."""
        if os.getpid() != self.pid:  # a forked child: the clocks are its parent's
            return
        with self._lock:
            for device, reset in list(self._resets.items()):
                try:
                    reset()
                except Exception as error:
                    warnings.warn(f"cannot reset the clocks of {device}: {error}",
                                  RuntimeWarning, stacklevel=2)
                else:
                    self.released(device)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            if signum in self._previous or (signum == signal.SIGABRT
                                            and faulthandler.is_enabled()):
                continue
            try:
                previous = signal.getsignal(signum)
                signal.signal(signum, self._handle)
            except (OSError, ValueError):  # not settable here
                continue
            self._previous[signum] = previous

    def _uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in list(self._previous.items()):
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, _settable(previous))
            del self._previous[signum]

    def _handle(self, signum: int, frame) -> None:
        """Reset the clocks, then let `signum` do what it would have done without us."""
        previous = _settable(self._previous.get(signum, signal.SIG_DFL))
        if os.getpid() == self.pid:
            self.reset_all()
        self._previous.pop(signum, None)
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action: the process ends by `signum`


def _settable(handler: object) -> object:
    """A handler `signal.signal` accepts: None (one installed outside Python) becomes the
    default action."""
    return signal.SIG_DFL if handler is None else handler


_process_guard: ClockGuard | None = None


def process_guard() -> ClockGuard:
    """This process's guard, made on first use (a forked child gets its own)."""
    global _process_guard
    if _process_guard is None or _process_guard.pid != os.getpid():
        _process_guard = ClockGuard()
    return _process_guard
