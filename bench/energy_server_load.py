"""Load on `merak energy serve`: many concurrent well-formed and malformed requests against a
local server (its own process), its peak memory above idle and the status of every answer.

    .venv/bin/python bench/energy_server_load.py --requests 1000

The mix: reports, schedule fetches and registrations that fit; 20 MB bodies (declared, and
chunked without a length), bodies just under the cap with too many values, NaN, a rank the job
did not register, an unknown job, broken JSON, a bad Content-Length, metadata that tries to
leave the results directory, and bodies that stall. Prints the server's idle and peak RSS
(VmHWM, reset after start-up) and the count per status; "no answer" counts connections that
ended without a status line. tests/test_energy_service_load.py runs a smaller mix.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIG = b"7," * (10 * 2**20)  # 20 MB of a JSON list's inside
CHUNK = 64 * 2**10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _plan(path: Path) -> Path:
    schedules = [{"rank": r, "frequencies": [["forward", 1410], ["backward", 1410]]}
                 for r in range(2)]
    path.write_text(json.dumps({"predicted": {"time_s": 1.0, "energy_j": 9.0},
                                "meta": {"stages": 2}, "schedules": schedules}))
    return path


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Server:
    """`merak energy serve` in its own process, on a free port, with a results directory."""

    def __init__(self, workdir: Path, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.results = workdir / "results"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "merak", "energy", "serve", "--plan",
             str(_plan(workdir / "plan.json")), "--port", str(self.port), "--results-dir",
             str(self.results), *extra], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/info", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {self.proc.stdout.read()}")\
                        from None
                time.sleep(0.2)

    def call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read() or b"null")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


def _request(method: str, path: str, body: bytes | None, headers: dict | None = None,
             chunked: bool = False) -> tuple[bytes, bytes | None, bool]:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             "Content-Type: application/json"]
    headers = dict(headers or {})
    if body is not None and not chunked:
        headers.setdefault("Content-Length", str(len(body)))
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), body, chunked


def mix(job: str, cap: int) -> list[tuple[str, tuple]]:
    """(kind, request) pairs: what each kind of client sends."""
    report = {"rank": 0, "iter_time": [1.0, 1.1], "iter_energy": [90.0, 91.0]}
    many = json.dumps({"rank": 0, "iter_time": [1.0] * (cap // 5),
                       "iter_energy": [1.0] * (cap // 5)}).encode()[:cap - 16]
    many = many[:many.rindex(b",")] + b"]}"  # just under the cap, too many values
    over_list = json.dumps({"rank": 0, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0,
                            "available_frequencies": [1410] * 5000}).encode()
    return [
        ("report", _request("POST", f"/result/{job}", json.dumps(report).encode())),
        ("schedule", _request("GET", f"/schedule/{job}?rank=1", None)),
        ("register", _request("POST", "/register_job", json.dumps(
            {"pp_degree": 2, "dp_degree": 1, "tp_degree": 1, "world_size": 2}).encode())),
        ("info", _request("GET", "/info", None)),
        ("20MB declared", _request("POST", f"/result/{job}", b"[" + BIG + b"1]")),
        ("20MB chunked", _request("POST", f"/result/{job}", b"[" + BIG + b"1]", chunked=True)),
        ("values over the cap", _request("POST", f"/result/{job}", many)),
        ("frequency list", _request("POST", f"/register_rank/{job}", over_list)),
        ("NaN", _request("POST", f"/result/{job}",
                         b'{"rank": 0, "iter_time": [NaN], "iter_energy": [1.0]}')),
        ("rank not registered", _request("POST", f"/result/{job}", json.dumps(
            {**report, "rank": 7}).encode())),
        ("unknown job", _request("POST", "/result/nope", json.dumps(report).encode())),
        ("broken JSON", _request("POST", f"/result/{job}", b'{"rank": 0, "iter_')),
        ("bad length", _request("POST", f"/result/{job}", b"{}",
                                headers={"Content-Length": "abc"})),
        ("path in metadata", _request("POST", "/register_job", json.dumps(
            {"pp_degree": 2, "dp_degree": 1, "tp_degree": 1, "world_size": 2,
             "job_metadata": "../../../etc/x"}).encode())),
    ]


async def _send(port: int, request: tuple, stall_s: float) -> str:
    head, body, chunked = request
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as error:
        return f"no connection ({type(error).__name__})"

    async def write() -> None:
        writer.write(head)
        if body is None:
            return
        if stall_s:  # half the body, then silence
            writer.write(body[:len(body) // 2])
            await writer.drain()
            await asyncio.sleep(stall_s)
        view = memoryview(body)
        for start in range(0, len(body), CHUNK):
            part = view[start:start + CHUNK]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    sending = asyncio.ensure_future(write())
    status = "no answer (closed)"
    try:
        line = await asyncio.wait_for(reader.readline(), 120)
    except (OSError, asyncio.TimeoutError) as error:
        line, status = b"", f"no answer ({type(error).__name__})"
    finally:
        sending.cancel()
        writer.close()
    if line.startswith(b"HTTP/1.1 "):
        return line.split()[1].decode()
    return status if not line else f"no answer ({line[:20]!r})"


async def _load(port: int, requests: list[tuple[str, tuple, float]]) -> list[tuple[str, str]]:
    answers = await asyncio.gather(*(_send(port, r, stall) for _, r, stall in requests))
    return [(kind, answer) for (kind, _, _), answer in zip(requests, answers)]


def run_load(server: Server, count: int, seed: int = 0, stall_s: float = 0.0,
             cap: int = 256 * 2**10) -> dict:
    """`count` concurrent requests of the mix against `server` (its job registered first);
    returns idle and peak memory (MiB), seconds, and the count per kind and status."""
    job = server.call("POST", "/register_job", {"pp_degree": 2, "dp_degree": 1,
                                                "tp_degree": 1, "world_size": 2})
    for rank in range(2):
        server.call("POST", f"/register_rank/{job}", {
            "rank": rank, "dp_rank": 0, "pp_rank": rank, "tp_rank": 0,
            "available_frequencies": [1410, 1395]})
    kinds = mix(job, cap)
    draw = random.Random(seed)
    requests = [(k, r, 0.0) for k, r in (kinds[i % len(kinds)] for i in range(count))]
    draw.shuffle(requests)
    if stall_s:  # a few clients that stop halfway through their body
        requests[:8] = [("stalled body", kinds[0][1], stall_s)] * 8
    time.sleep(1.0)
    idle = memory_kib(server.proc.pid, "VmRSS")
    server.reset_peak()
    start = time.perf_counter()
    answers = asyncio.run(_load(server.port, requests))
    took = time.perf_counter() - start
    peak = memory_kib(server.proc.pid, "VmHWM")
    by_status = collections.Counter(answer for _, answer in answers)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, answer in answers:
        by_kind[kind][answer] += 1
    info = server.call("GET", "/info")
    return {"requests": count, "seconds": round(took, 1), "idle_mib": round(idle / 1024, 1),
            "peak_mib": round(peak / 1024, 1), "above_idle_mib": round((peak - idle) / 1024, 1),
            "status": dict(sorted(by_status.items())),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
            "server": {k: info[k] for k in ("job_count", "jobs_forgotten", "results")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--stall", type=float, default=6.0,
                        help="seconds 8 clients stall mid-body (the server's body timeout: 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), "--body-timeout", "5")
        try:
            result = run_load(server, args.requests, stall_s=args.stall)
        finally:
            log = server.stop()
        written = sorted(p.name for p in server.results.rglob("*"))
        escaped = [p for p in Path(tmp).rglob("x*") if server.results not in p.parents]
    print(json.dumps(result, indent=1))
    print(f"results files: {len(written)} in the results directory, {len(escaped)} outside it")
    bad = {s: n for s, n in result["status"].items() if s[:1] not in "24"}
    print(f"peak {result['above_idle_mib']} MiB above idle; answers outside 2xx/4xx: "
          f"{bad or 'none'}")
    if log.strip():
        print("server log:", log[-2000:])


if __name__ == "__main__":
    main()
