"""`merak energy serve`: a Perseus (Zeus PFO) server that hands out `merak energy plan` plans.

It speaks the protocol of `merak.energy.service.pfo_protocol` (Zeus's endpoints and fields), so
Zeus's pipeline-frequency client and ours both train from it. Each served plan is matched to a job
at registration by world size (and by pipeline degree when the plan records it); every rank's
measured steps are kept per job and, with a results directory, appended there as JSON lines. It
stays up under any client (`merak.energy.service.pfo_limits`): request bodies and list lengths are
capped, few requests are handled at once, results are bounded per job and in all, a reporting rank
must be one the job registered, NaN is refused, and plans are validated when loaded.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

from merak.energy.planning.plan_file import load_clock_plan, validate_clock_plan
from merak.energy.service.pfo_limits import RequestLimits, ResultStore
from merak.energy.service.pfo_protocol import (
    GET_FREQUENCY_SCHEDULE_URL,
    GET_SERVER_INFO_URL,
    REGISTER_JOB_URL,
    REGISTER_RANK_URL,
    REPORT_PROFILING_RESULT_URL,
    FrequencySchedule,
    JobInfo,
    ProfilingResult,
    RankInfo,
)


class _Job:
    def __init__(self, job_id: str, info: JobInfo, plan: dict, store: ResultStore):
        self.job_id, self.info, self.plan, self._store = job_id, info, plan, store
        self.schedules = {s["rank"]: s["frequencies"] for s in plan["schedules"]}
        self.ranks: dict[int, RankInfo] = {}

    @property
    def results(self) -> list[ProfilingResult]:
        """The reported windows kept (the newest, within the store's bounds), oldest first."""
        return [ProfilingResult.model_validate_json(data)
                for data in self._store.results(self.job_id)]


def _safe(text: str) -> str:
    """Job metadata as part of a job id and a file name: letters, digits, '.', '_', '-'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64].lstrip(".")


class PlanRegistry:
    """The jobs and the plans they are served from (the FastAPI app's state). Every plan is
    validated when the registry is made; at most `max_jobs` jobs are kept (the one idle longest
    is forgotten first), and their results live in a bounded `ResultStore`."""

    def __init__(self, plans: list[dict], results_dir: str | Path | None = None, *,
                 max_jobs: int = 1024, store: ResultStore | None = None):
        if not plans:
            raise ValueError("serve at least one plan (merak energy serve --plan plan.json)")
        self.plans = [validate_clock_plan(plan, f"plan {i}") for i, plan in enumerate(plans)]
        self.results_dir = Path(results_dir) if results_dir else None
        self.store = store or ResultStore(directory=self.results_dir)
        self.max_jobs, self.forgotten = max_jobs, 0
        self.jobs: OrderedDict[str, _Job] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _match(self, info: JobInfo) -> dict:
        for plan in self.plans:
            stages = plan.get("meta", {}).get("stages")
            if len(plan["schedules"]) == info.world_size and stages in (None, info.pp_degree):
                return plan
        served = [(len(p["schedules"]), p.get("meta", {}).get("stages")) for p in self.plans]
        raise LookupError(f"no served plan fits a job of {info.world_size} ranks with "
                          f"pp={info.pp_degree}; served plans (ranks, stages): {served}")

    def register_job(self, info: JobInfo) -> str:
        plan = self._match(info)
        with self._lock:
            job_id = "+".join([time.strftime("%Y-%m-%d-%H-%M-%S"), f"dp{info.dp_degree}",
                               f"pp{info.pp_degree}", f"tp{info.tp_degree}",
                               f"merak{next(self._ids)}"])
            if info.job_metadata:
                job_id += f"+{_safe(info.job_metadata)}"
            self.jobs[job_id] = _Job(job_id, info, plan, self.store)
            while len(self.jobs) > self.max_jobs:  # the job idle longest
                forgotten, _ = self.jobs.popitem(last=False)
                self.store.drop_job(forgotten)
                self.forgotten += 1
        return job_id

    def job(self, job_id: str) -> _Job:
        """(Called with the lock held.) The job, now the most recently active."""
        if job_id not in self.jobs:
            raise KeyError(f"unknown job {job_id[:200]!r}: register it first "
                           f"({REGISTER_JOB_URL})")
        self.jobs.move_to_end(job_id)
        return self.jobs[job_id]

    def register_rank(self, job_id: str, info: RankInfo) -> None:
        with self._lock:
            job = self.job(job_id)
            if info.rank >= job.info.world_size:
                raise ValueError(f"rank {info.rank} is outside job {job_id} "
                                 f"(world size {job.info.world_size})")
            unknown = sorted({mhz for _, mhz in job.schedules[info.rank]}
                             - set(info.available_frequencies))
            if unknown:
                raise ValueError(f"the plan runs rank {info.rank} at {unknown[:8]} MHz, which "
                                 f"its GPU does not support")
            job.ranks[info.rank] = info

    def schedule(self, job_id: str, rank: int) -> FrequencySchedule:
        with self._lock:
            job = self.job(job_id)
            if rank not in job.ranks:
                raise ValueError(f"rank {rank} of job {job_id} is not registered "
                                 f"({REGISTER_RANK_URL.format(job_id=job_id)})")
            return FrequencySchedule(rank=rank, frequencies=job.schedules[rank])

    def report(self, job_id: str, result: ProfilingResult) -> None:
        with self._lock:
            job = self.job(job_id)
            if result.rank not in job.ranks:
                raise ValueError(f"rank {result.rank} reports for job {job_id}, but it is not "
                                 f"one of its registered ranks {sorted(job.ranks)[:16]} "
                                 f"({REGISTER_RANK_URL.format(job_id=job_id)})")
            self.store.add(job_id, result.model_dump_json().encode())

    def info(self) -> dict:
        with self._lock:
            store = self.store
            return {"server": "merak",
                    "plans": [{"ranks": len(p["schedules"]), "meta": p.get("meta", {}),
                               "predicted": p.get("predicted")} for p in self.plans],
                    "jobs": list(self.jobs)[-100:], "job_count": len(self.jobs),
                    "jobs_forgotten": self.forgotten,
                    "results": {"bytes_kept": store.bytes, "dropped": store.dropped,
                                "bytes_written": store.written,
                                "not_written": store.not_written}}


def create_app(registry: PlanRegistry, limits: dict | None = None):
    """The FastAPI application serving `registry`, behind `RequestLimits` (`limits`: its
    keywords). A request FastAPI cannot validate is answered 422 with its first errors, without
    echoing the request back."""
    from fastapi import FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="merak energy serve (Perseus PFO protocol)")
    app.state.registry = registry

    def call(fn, *args):
        try:
            return fn(*args)
        except KeyError as error:
            raise HTTPException(404, str(error.args[0])) from None
        except (LookupError, ValueError) as error:
            raise HTTPException(400, str(error)) from None

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        errors = [{"loc": list(e.get("loc", ()))[:6], "msg": str(e.get("msg", ""))[:200]}
                  for e in error.errors()[:3]]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.get(GET_SERVER_INFO_URL)
    def info() -> dict:
        return registry.info()

    @app.post(REGISTER_JOB_URL, response_model=str)
    def register_job(job_info: JobInfo) -> str:
        return call(registry.register_job, job_info)

    @app.post(REGISTER_RANK_URL)
    def register_rank(job_id: str, rank_info: RankInfo) -> None:
        call(registry.register_rank, job_id, rank_info)

    @app.get(GET_FREQUENCY_SCHEDULE_URL, response_model=FrequencySchedule)
    def schedule(job_id: str, rank: int) -> FrequencySchedule:
        return call(registry.schedule, job_id, rank)

    @app.post(REPORT_PROFILING_RESULT_URL)
    def report(job_id: str, profiling_result: ProfilingResult) -> None:
        call(registry.report, job_id, profiling_result)

    return RequestLimits(app, **(limits or {}))


def load_plans(paths: list[str]) -> list[dict]:
    """Every plan file, validated (`ClockPlanError` names the first that is not a plan)."""
    return [load_clock_plan(path) for path in paths]


def serve(plan_paths: list[str], host: str = "127.0.0.1", port: int = 7787,
          results_dir: str | None = None, limits: dict | None = None,
          max_jobs: int = 1024) -> None:
    import uvicorn

    registry = PlanRegistry(load_plans(plan_paths), results_dir, max_jobs=max_jobs)
    print(json.dumps({"serving": plan_paths, "url": f"http://{host}:{port}"}), flush=True)
    uvicorn.run(create_app(registry, limits), host=host, port=port, log_level="warning",
                timeout_keep_alive=5)


class ServerThread:
    """`merak energy serve` inside this process, on a free port (tests, notebooks)."""

    def __init__(self, registry: PlanRegistry, host: str = "127.0.0.1",
                 limits: dict | None = None):
        import socket

        import uvicorn

        self.registry = registry
        self._socket = socket.socket()
        self._socket.bind((host, 0))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(create_app(registry, limits),
                                                        log_level="warning"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the plan server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
