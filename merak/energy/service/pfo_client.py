"""The client side of the Perseus (Zeus PFO) protocol: register the job and its ranks, fetch each
rank's FrequencySchedule, report measured steps. Works against `merak energy serve` and Zeus's
PFO server alike.

HTTP goes through the standard library (`urllib`): four JSON calls do not justify a client
dependency on every training node.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from merak.distributed.host_objects import all_gather_objects, broadcast_object
from merak.energy.service.pfo_protocol import (
    GET_FREQUENCY_SCHEDULE_URL,
    REGISTER_JOB_URL,
    REGISTER_RANK_URL,
    REPORT_PROFILING_RESULT_URL,
    FrequencySchedule,
    JobInfo,
    ProfilingResult,
    RankInfo,
)


class PFOError(RuntimeError):
    """The Perseus server could not be reached or refused a request."""


class PFOClient:
    def __init__(self, url: str, timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"pfo_server_url must be an http(s) URL, got {url!r}")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def _call(self, method: str, path: str, body=None):
        data = None if body is None else body.model_dump_json().encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode()
            try:
                detail = json.loads(detail).get("detail", detail)
            except (json.JSONDecodeError, AttributeError):
                pass
            raise PFOError(f"the Perseus server at {self.url} refused {method} {path} "
                           f"(HTTP {error.code}): {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise PFOError(f"cannot reach the Perseus server at {self.url} ({method} {path}): "
                           f"{getattr(error, 'reason', error)}; start one with `merak energy "
                           f"serve --plan plan.json` or fix pfo_server_url") from None
        return json.loads(text) if text else None

    def register_job(self, info: JobInfo) -> str:
        return self._call("POST", REGISTER_JOB_URL, info)

    def register_rank(self, job_id: str, info: RankInfo) -> None:
        self._call("POST", REGISTER_RANK_URL.format(job_id=job_id), info)

    def schedule(self, job_id: str, rank: int) -> FrequencySchedule:
        path = GET_FREQUENCY_SCHEDULE_URL.format(job_id=job_id) + f"?rank={rank}"
        return FrequencySchedule.model_validate(self._call("GET", path))

    def report(self, job_id: str, result: ProfilingResult) -> None:
        self._call("POST", REPORT_PROFILING_RESULT_URL.format(job_id=job_id), result)


def _on_every_rank(ctx, call):
    """`call()` on this rank; when it fails on any rank, raise on every rank, so that no rank is
    left waiting in a collective."""
    result, error = None, None
    try:
        result = call()
    except PFOError as e:
        error = str(e)
    errors = all_gather_objects(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise PFOError("; ".join(f"rank {rank}: {e}" for rank, e in failed))
    return result


def join_job(client: PFOClient, ctx, clocks: list[int], metadata: str | None = None) -> str:
    """Register the job (rank 0) and every rank; returns the job id on every rank."""
    info = JobInfo(pp_degree=ctx.pp, dp_degree=ctx.dp, tp_degree=ctx.tp,
                   world_size=ctx.world_size, job_metadata=metadata)
    job_id = broadcast_object(
        _on_every_rank(ctx, lambda: client.register_job(info) if ctx.rank == 0 else None), src=0)
    _on_every_rank(ctx, lambda: client.register_rank(job_id, RankInfo(
        rank=ctx.rank, dp_rank=ctx.dp_rank, pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank,
        available_frequencies=clocks)))
    return job_id


def fetch_schedules(client: PFOClient, job_id: str, ctx) -> list[dict]:
    """Every rank's schedule, on every rank (for `check_clock_plan` to see the whole plan)."""
    mine = _on_every_rank(ctx, lambda: client.schedule(job_id, ctx.rank).model_dump())
    return all_gather_objects(mine)
