"""What keeps `merak energy serve` up under any client: each request's body capped, few handled
at once, and the reported results bounded in memory and on disk.

`RequestLimits` (ASGI middleware) answers 413 to a body over ``max_body_bytes`` (by its
Content-Length before keeping anything, or once a chunked body passes the cap; the rest is read
and dropped for a few seconds, so the client sees the answer), 408 to a body
that does not arrive within ``body_timeout_s``; ``readers`` bodies are received at once (the
other requests wait, their sockets unread) and ``concurrency`` requests parsed and handled at
once. Memory is so bounded by ``readers`` x ``max_body_bytes`` plus ``concurrency`` parsed
requests however many clients connect; slow clients hold a reader each, for at most the
body deadline.
`ResultStore` keeps each job's reported windows as their JSON, oldest dropped first (per job and
in all), and appends them to ``<job>.jsonl`` with a size cap per file and in all.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path

KIB, MIB = 2**10, 2**20


async def _answer(send, status: int, detail: str, receive=None, drain_s: float = 0.0) -> None:
    """Answer `status` and close; with `receive`, first read and drop what the client still
    sends for up to `drain_s` (so it reads the answer: closing on unread data resets the
    connection, and the client would lose it)."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    if receive is not None:
        try:
            await asyncio.wait_for(_drop_body(receive), drain_s)
        except asyncio.TimeoutError:
            pass
    await send({"type": "http.response.body", "body": body})


async def _drop_body(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


class RequestLimits:
    """ASGI middleware: a body size cap and deadline, a bound on the bodies being received at
    once (`readers`) and on the requests parsed and handled at once (`concurrency`)."""

    def __init__(self, app, max_body_bytes: int = 256 * KIB, concurrency: int = 8,
                 readers: int = 128, body_timeout_s: float = 30.0, drain_s: float = 5.0):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.drain_s = drain_s  # how long a refused body is read (and dropped) before closing
        self.concurrency, self.readers = concurrency, readers
        self._slots: tuple[asyncio.Semaphore, asyncio.Semaphore] | None = None  # (the loop's)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _answer(send, 413 if length.isdigit() else 400,
                          f"the request body must be at most {self.max_body_bytes} bytes "
                          f"(Content-Length {length.decode(errors='replace')[:20]})",
                          receive, self.drain_s)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.readers), asyncio.Semaphore(self.concurrency)
        reading, handling = self._slots
        async with reading:
            try:
                body = await asyncio.wait_for(self._read(receive), self.body_timeout_s)
            except asyncio.TimeoutError:
                await _answer(send, 408, f"the request body did not arrive within "
                                         f"{self.body_timeout_s:g} s")
                return
            if body is None:  # the client left
                return
            if len(body) > self.max_body_bytes:
                del body
                await _answer(send, 413, f"the request body must be at most "
                                         f"{self.max_body_bytes} bytes", receive, self.drain_s)
                return
            async with handling:
                await self.app(scope, _replay(bytes(body), receive), send)

    async def _read(self, receive) -> bytearray | None:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes or not message.get("more_body", False):
                return body


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # (the disconnect, once the client leaves)
    return replay


class _Entry:
    __slots__ = ("job_id", "data")

    def __init__(self, job_id: str, data: bytes):
        self.job_id, self.data = job_id, data


class ResultStore:
    """Reported windows per job as JSON bytes: at most `per_job` per job and `max_bytes` in all
    in memory (the oldest dropped first); with `directory`, every one appended to
    ``<job>.jsonl`` (moved to ``<job>.jsonl.1`` past `file_bytes`), until `disk_bytes` were
    written in all. Not thread-safe: its owner holds a lock."""

    def __init__(self, per_job: int = 256, max_bytes: int = 32 * MIB,
                 directory: str | Path | None = None, file_bytes: int = 16 * MIB,
                 disk_bytes: int = 1024 * MIB):
        self.per_job, self.max_bytes = per_job, max_bytes
        self.directory = Path(directory) if directory else None
        self.file_bytes, self.disk_bytes = file_bytes, disk_bytes
        self._jobs: dict[str, deque[_Entry]] = {}
        self._order: deque[_Entry] = deque()  # every entry kept, oldest first
        self.bytes = self.written = 0
        self.dropped = self.not_written = 0

    def add(self, job_id: str, data: bytes) -> None:
        entry = _Entry(job_id, data)
        kept = self._jobs.setdefault(job_id, deque())
        kept.append(entry)
        self._order.append(entry)
        self.bytes += len(data)
        while len(kept) > self.per_job:
            self._forget(kept.popleft())
        while self.bytes > self.max_bytes and self._order:
            oldest = self._order[0]
            if oldest.data is None:
                self._order.popleft()
            else:
                self._forget(self._jobs[oldest.job_id].popleft())
        if len(self._order) > 2 * sum(map(len, self._jobs.values())) + 64:
            self._order = deque(e for e in self._order if e.data is not None)
        self._write(job_id, data)

    def _forget(self, entry: _Entry) -> None:
        self.bytes -= len(entry.data)
        entry.data = None
        self.dropped += 1

    def results(self, job_id: str) -> list[bytes]:
        return [e.data for e in self._jobs.get(job_id, ())]

    def drop_job(self, job_id: str) -> None:
        for entry in self._jobs.pop(job_id, ()):
            self.bytes -= len(entry.data)
            entry.data = None

    def _write(self, job_id: str, data: bytes) -> None:
        if self.directory is None:
            return
        if self.written + len(data) + 1 > self.disk_bytes:
            self.not_written += 1
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{job_id}.jsonl"
        if path.exists() and path.stat().st_size + len(data) + 1 > self.file_bytes:
            path.replace(path.with_name(path.name + ".1"))
        with open(path, "ab") as f:
            f.write(data + b"\n")
        self.written += len(data) + 1
