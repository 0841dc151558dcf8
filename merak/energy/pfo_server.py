"""`merak energy serve`: a Perseus (Zeus PFO) server that hands out `merak energy plan` plans.

It speaks the protocol of `merak.energy.pfo_protocol` (Zeus's endpoints and fields), so Zeus's
pipeline-frequency client and ours both train from it. Each served plan is matched to a job at
registration by world size (and by pipeline degree when the plan records it); every rank's
measured steps are kept per job and, with a results directory, appended there as JSON lines.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

from merak.energy.pfo_protocol import (
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
    def __init__(self, info: JobInfo, plan: dict):
        self.info, self.plan = info, plan
        self.schedules = {s["rank"]: s["frequencies"] for s in plan["schedules"]}
        self.ranks: dict[int, RankInfo] = {}
        self.results: list[ProfilingResult] = []


class PlanRegistry:
    """The jobs and the plans they are served from (the FastAPI app's state)."""

    def __init__(self, plans: list[dict], results_dir: str | Path | None = None):
        if not plans:
            raise ValueError("serve at least one plan (merak energy serve --plan plan.json)")
        self.plans, self.results_dir = plans, Path(results_dir) if results_dir else None
        self.jobs: dict[str, _Job] = {}
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
                job_id += f"+{info.job_metadata}"
            self.jobs[job_id] = _Job(info, plan)
        return job_id

    def job(self, job_id: str) -> _Job:
        if job_id not in self.jobs:
            raise KeyError(f"unknown job {job_id!r}: register it first ({REGISTER_JOB_URL})")
        return self.jobs[job_id]

    def register_rank(self, job_id: str, info: RankInfo) -> None:
        job = self.job(job_id)
        if info.rank >= job.info.world_size:
            raise ValueError(f"rank {info.rank} is outside job {job_id} "
                             f"(world size {job.info.world_size})")
        unknown = sorted({mhz for _, mhz in job.schedules[info.rank]}
                         - set(info.available_frequencies))
        if unknown:
            raise ValueError(f"the plan runs rank {info.rank} at {unknown} MHz, which its GPU "
                             f"does not support")
        job.ranks[info.rank] = info

    def schedule(self, job_id: str, rank: int) -> FrequencySchedule:
        job = self.job(job_id)
        if rank not in job.ranks:
            raise ValueError(f"rank {rank} of job {job_id} is not registered "
                             f"({REGISTER_RANK_URL.format(job_id=job_id)})")
        return FrequencySchedule(rank=rank, frequencies=job.schedules[rank])

    def report(self, job_id: str, result: ProfilingResult) -> None:
        job = self.job(job_id)
        job.results.append(result)
        if self.results_dir is not None:
            self.results_dir.mkdir(parents=True, exist_ok=True)
            with open(self.results_dir / f"{job_id}.jsonl", "a") as f:
                f.write(result.model_dump_json() + "\n")


def create_app(registry: PlanRegistry):
    """The FastAPI application serving `registry`."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="merak energy serve (Perseus PFO protocol)")
    app.state.registry = registry

    def call(fn, *args):
        try:
            return fn(*args)
        except KeyError as error:
            raise HTTPException(404, str(error.args[0])) from None
        except (LookupError, ValueError) as error:
            raise HTTPException(400, str(error)) from None

    @app.get(GET_SERVER_INFO_URL)
    def info() -> dict:
        return {"server": "merak", "plans": [{"ranks": len(p["schedules"]),
                                              "meta": p.get("meta", {}),
                                              "predicted": p.get("predicted")}
                                             for p in registry.plans],
                "jobs": list(registry.jobs)}

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

    return app


def load_plans(paths: list[str]) -> list[dict]:
    from merak.energy.plan_file import load_clock_plan

    return [load_clock_plan(path) for path in paths]


def serve(plan_paths: list[str], host: str = "127.0.0.1", port: int = 7787,
          results_dir: str | None = None) -> None:
    import uvicorn

    registry = PlanRegistry(load_plans(plan_paths), results_dir)
    print(json.dumps({"serving": plan_paths, "url": f"http://{host}:{port}"}))
    uvicorn.run(create_app(registry), host=host, port=port, log_level="warning")


class ServerThread:
    """`merak energy serve` inside this process, on a free port (tests, notebooks)."""

    def __init__(self, registry: PlanRegistry, host: str = "127.0.0.1"):
        import socket

        import uvicorn

        self.registry = registry
        self._socket = socket.socket()
        self._socket.bind((host, 0))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(create_app(registry), log_level="warning"))
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
