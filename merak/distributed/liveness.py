"""Who did not arrive: each rank's sign of life in the job's store, read when a wait fails.

gloo and NCCL end a wait on a stopped or dead peer with a timeout or "Connection closed by peer
[address]", naming no rank. Every rank of a multi-rank job (`merak.init`) runs a `Beacon`: a
daemon thread that writes, once a second, a beat counter, the rank's state and what it is doing
(``where``: the labels of the `waiting` blocks it is in and the interpreter's current action,
set by plain attribute writes, no store round-trip) into the job's TCPStore (torchrun's agent
holds it; without torchrun, rank 0). Nothing else is read or written in the steady state.

The host keeps a deadline of its own, below the job's timeout (`host_deadline_s`): where a rank
makes no progress inside a labelled wait (no new `waiting` block, no new interpreter action) for
that long, the beacon thread diagnoses the wait as below, publishes and prints the diagnosis and,
on NCCL, aborts the process groups. NCCL's waits do not block the host where they are posted (a
rank blocked on a collective sits in a later host read, and NCCL's own watchdog kills it at the
timeout without a Python error), so without this deadline no NCCL job would name its missing
peer; on gloo the diagnosis comes first and gloo's own timeout then raises it.

When a wait ends in an error, `waiting` reads every rank's beacon twice, a few beats apart, with
a short timeout: a rank whose counter did not move is stopped, hung in native code, or dead; one
that exited or gave up first says so (its own diagnosis travels in the store). The error,
`PeerFailureError`, names those ranks, the action, the measured time, the job's timeout and what
to check; this rank then publishes it, so a rank that loses its connection to one that gave up
names the same missing peer.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist

from merak.distributed.host_identity import host_identity

INTERVAL_S = 1.0  # between beats; a diagnosis waits a few of them
_FAILURE = re.compile(r"Timed out|timed out|timeout|Connection (closed|reset)|Broken pipe|"
                      r"Socket|NCCL communicator was aborted|Watchdog|did not complete", re.I)


class PeerFailureError(RuntimeError):
    """A wait for other ranks ended (its timeout passed, or a peer closed its connection); the
    message names the rank(s) that did not arrive, the action, the time and what to check."""


def _tcp_store(store):
    while not isinstance(store, dist.TCPStore):
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return store


def _client(host: str, port: int, timeout_s: float):
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(
        seconds=timeout_s), wait_for_workers=False)


class Beacon:
    """This rank's sign of life (see the module doc); `start` makes the process's one."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, prefix: str,
                 interval_s: float = INTERVAL_S):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.prefix, self.interval_s = prefix, interval_s
        self.labels: list[str] = []  # the `waiting` blocks this rank is in, outermost first
        self.opened: list[float] = []  # when each was entered (monotonic)
        self.peers: list[Sequence[int] | None] = []  # whom each waits for
        self.deadline_message: str | None = None  # the host deadline's diagnosis, once
        self.detail: object = None  # the interpreter's current action
        self.detail_since = time.monotonic()
        self.state, self.message = "running", ""
        self._beats, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="merak-beacon", daemon=True)
        self._thread.start()

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def where(self) -> str:
        parts, detail = list(self.labels), self.detail
        if getattr(detail, "microbatch_id", None) is not None:
            parts.append(f"{detail.name} of micro-batch {detail.microbatch_id} on stage "
                         f"{detail.stage_id}")
        elif detail is not None:
            parts.append(str(getattr(detail, "name", detail)))
        return " > ".join(parts) or "between collectives"

    def _value(self) -> bytes:
        return json.dumps({"n": self._beats, "t": time.time(), "state": self.state,
                           "where": self.where()[:300], "message": self.message[:2000],
                           "pid": os.getpid(), "host": os.uname().nodename,
                           "host_id": host_identity()}).encode()

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            self._beats += 1
            try:
                store = store or _client(self.host, self.port, 5.0)
                store.set(self.key(self.rank), self._value())
            except Exception:  # noqa: BLE001 - the store may be gone (the job is ending)
                store = None
            self.check_deadline(time.monotonic(), job_timeout_s())
            self._stop.wait(self.interval_s)

    def stalled_s(self, now: float) -> float:
        """How long this rank has made no progress inside a labelled wait (0 outside one)."""
        if not self.labels or not self.opened:
            return 0.0
        return max(0.0, now - max(self.opened[-1], self.detail_since))

    def check_deadline(self, now: float, timeout_s: float | None) -> str | None:
        """Diagnose (once) a wait stalled past `host_deadline_s`; returns the diagnosis."""
        if self.deadline_message is not None or not timeout_s or not self.labels:
            return None
        stalled = self.stalled_s(now)
        if stalled < host_deadline_s(timeout_s):
            return None
        try:
            action, peers = self.labels[-1], self.peers[-1] if self.peers else None
        except IndexError:  # the block ended meanwhile
            return None
        text = diagnose(f"{action} (the host's deadline, before the backend's timeout)",
                        stalled, None, peers)
        self.deadline_message = text
        print(f"[rank{self.rank}]: merak: {text}", file=sys.stderr, flush=True)
        if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:  # the blocked host read then fails: `waiting` raises
                with contextlib.suppress(Exception):
                    abort()
        return text

    def publish(self, state: str, message: str = "") -> None:
        """Set this rank's state ("failed": it gave up, with its diagnosis; "exited") now."""
        if self.state == "failed" and state == "exited":
            return  # the diagnosis is what peers need
        self.state, self.message = state, message
        with contextlib.suppress(Exception):
            _client(self.host, self.port, 2.0).set(self.key(self.rank), self._value())

    def stop(self) -> None:
        self.publish("exited")
        self._stop.set()

    def read_all(self, timeout_s: float = 3.0) -> dict[int, dict] | str:
        """Every rank's beacon (rank -> value; absent keys left out), or why it cannot be read."""
        try:
            store = _client(self.host, self.port, timeout_s)
            keys = [self.key(r) for r in range(self.world_size)]
            present = keys if store.check(keys) else [k for k in keys if store.check([k])]
            values = store.multi_get(present) if present else []
        except Exception as error:  # noqa: BLE001 - a stopped or dead store host
            host = "rank 0's process" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != \
                "True" else "torchrun's agent"
            return (f"the job's store at {self.host}:{self.port} ({host} holds it) did not "
                    f"answer within {timeout_s:g} s ({str(error).splitlines()[0][:120]})")
        return {int(k[len(self.prefix):]): json.loads(bytes(v)) for k, v in zip(present, values)}


_beacon: Beacon | None = None


def start(rank: int, world_size: int) -> Beacon | None:
    """This process's beacon for the default process group's store (once; a no-op for one rank
    or a store that is not a TCPStore)."""
    global _beacon
    store = _tcp_store(dist.distributed_c10d._get_default_store()) \
        if dist.is_initialized() else None
    if world_size < 2 or store is None:
        return _beacon
    if _beacon is not None and (_beacon.host, _beacon.port, _beacon.rank) == \
            (store.host, store.port, rank):
        return _beacon
    if _beacon is not None:
        _beacon.stop()
    # per torchrun attempt: a restarted job must not read the dead attempt's beacons
    prefix = (f"merak/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
              f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/beacon/")
    _beacon = Beacon(store.host, store.port, rank, world_size, prefix)
    atexit.register(_beacon.stop)
    _chain_excepthook()
    return _beacon


def _chain_excepthook() -> None:
    """An uncaught exception is published before the traceback: peers name it. An uncaught
    `PeerFailureError` then ends the process at once, as Python would (the traceback, the
    atexit functions, status 1) but without the final garbage collection of the interpreter's
    objects, which takes seconds for a torch + transformers heap on a busy host: the peers that
    wait on this rank learn that it left when its connections close."""
    if getattr(sys.excepthook, "_merak", False):
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if _beacon is not None:
            first = str(value).strip().splitlines()[0][:300] if str(value).strip() else ""
            _beacon.publish("exited", f"{kind.__name__}: {first}")
        previous(kind, value, traceback)
        if isinstance(value, PeerFailureError) and threading.current_thread() is \
                threading.main_thread():
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)
    hook._merak = True
    sys.excepthook = hook


def current() -> Beacon | None:
    return _beacon


def mark(detail: object) -> None:
    """The action this rank now runs (the interpreter's, per action): two attribute writes."""
    beacon = _beacon
    if beacon is not None:
        beacon.detail, beacon.detail_since = detail, time.monotonic()


def is_peer_failure(error: BaseException) -> bool:
    """A backend's error for a wait that timed out or lost its peer."""
    if isinstance(error, PeerFailureError):
        return False
    kinds = tuple(getattr(dist, n) for n in ("DistBackendError", "DistNetworkError",
                                             "DistStoreError") if hasattr(dist, n))
    return isinstance(error, kinds) or (isinstance(error, RuntimeError)
                                        and bool(_FAILURE.search(str(error))))


@contextlib.contextmanager
def waiting(action: str, peers: Sequence[int] | None = None,
            group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Label what this rank waits for inside (`action`, its `peers` or `group`); a backend's
    failure inside becomes `PeerFailureError` with the diagnosis. Nested blocks refine the
    label; the innermost one diagnoses."""
    beacon, start_time = _beacon, time.monotonic()
    if peers is None and group is not None:
        peers = dist.get_process_group_ranks(group)
    if beacon is not None:
        beacon.opened.append(start_time)
        beacon.peers.append(peers)
        beacon.labels.append(action)
        beacon.detail = None
    try:
        yield
        if beacon is not None and beacon.state == "failed":  # a failure was caught: going on
            beacon.state, beacon.message, beacon.deadline_message = "running", "", None
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        found = beacon.deadline_message if beacon is not None else None
        raise PeerFailureError(found or diagnose(action, time.monotonic() - start_time, error,
                                                 peers)) from error
    finally:
        if beacon is not None and beacon.labels and beacon.labels[-1] == action:
            beacon.labels.pop()
            beacon.opened.pop()
            beacon.peers.pop()


def waiting_in(label: str | Callable[..., str]) -> Callable:
    """A method decorator: its body runs in ``waiting(label)`` (`label(self)` when callable)."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def inner(self, *args, **kwargs):
            with waiting(label(self) if callable(label) else label):
                return method(self, *args, **kwargs)
        return inner
    return wrap


def host_deadline_s(timeout_s: float) -> float:
    """How long a rank may make no progress inside a wait before its host diagnoses the wait:
    the job's timeout less a margin for the diagnosis (10%, at least 3 s, at most 30 s), and at
    least half the timeout (a test's timeout of a few seconds)."""
    return max(0.5 * timeout_s, timeout_s - min(30.0, max(3.0, 0.1 * timeout_s)))


def job_timeout_s() -> float | None:
    try:
        group = dist.distributed_c10d._get_default_group()
        return next(group._get_backend(d).options._timeout.total_seconds()
                    for d in group._device_types)
    except (AttributeError, RuntimeError, StopIteration, ValueError):
        return None


def diagnose(action: str, waited_s: float, error: BaseException | None,
             peers: Sequence[int] | None = None) -> str:
    """The message of a failed wait (see the module doc); this rank publishes it."""
    from merak.distributed.peer_report import describe, local_state  # (the wording, apart)

    beacon, rank = _beacon, dist.get_rank() if dist.is_initialized() else 0
    first = second = "no beacons: a one-rank job, or a store that is not a TCPStore"
    if beacon is not None:
        first = second = beacon.read_all()
        states = [local_state(v) for r, v in first.items() if r != rank] \
            if isinstance(first, dict) else []
        if None in states or (states and not {"stopped", "dead"} & set(states)):
            time.sleep(2.0 * beacon.interval_s)  # a live rank beats meanwhile; a hung one not
            second = beacon.read_all()
    world = dist.get_world_size() if dist.is_initialized() else 1
    text = describe(rank, action, waited_s, job_timeout_s(), error, peers, first, second, world)
    if beacon is not None:
        beacon.publish("failed", text)
    return text
