"""The Perseus (Zeus pipeline frequency optimizer, "PFO") HTTP protocol, as pydantic 2 models.

The field names and endpoints are those of Zeus's ``zeus.optimizer.pipeline_frequency``, so
our client talks to a Zeus PFO server and Zeus's client talks to ``merak energy serve``:

- ``POST /register_job`` with a `JobInfo` -> the job id (a JSON string);
- ``POST /register_rank/{job_id}`` with a `RankInfo`;
- ``GET /schedule/{job_id}?rank=R`` -> that rank's `FrequencySchedule`;
- ``POST /result/{job_id}`` with a `ProfilingResult` (the measured window of steps);
- ``GET /info`` -> what the server serves.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

# what one request may hold (a server that trusts its clients can be flooded): list lengths and
# names; `merak energy serve` also caps each request's bytes
MAX_VALUES = 4096  # steps of a reported window, values of one breakdown row, clocks of a GPU
MAX_NAMES = 64  # instruction kinds of a breakdown
MAX_TEXT = 256  # job metadata, instruction names
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Values = Annotated[list[Seconds], Field(max_length=MAX_VALUES)]
Breakdown = Annotated[dict[Annotated[str, Field(max_length=MAX_TEXT)],
                           Annotated[list[Values], Field(max_length=MAX_VALUES)]],
                      Field(max_length=MAX_NAMES)]

REGISTER_JOB_URL = "/register_job"
REGISTER_RANK_URL = "/register_rank/{job_id}"
GET_FREQUENCY_SCHEDULE_URL = "/schedule/{job_id}"
REPORT_PROFILING_RESULT_URL = "/result/{job_id}"
GET_SERVER_INFO_URL = "/info"


class JobInfo(BaseModel):
    """A training job, registered by its rank 0; the server assigns `job_id`."""

    job_id: str = ""
    pp_degree: int = Field(ge=1)
    dp_degree: int = Field(ge=1)
    tp_degree: int = Field(ge=1)
    world_size: int = Field(ge=1)
    job_metadata: str | None = Field(default=None, max_length=MAX_TEXT)

    @model_validator(mode="after")
    def _layout(self) -> JobInfo:
        if self.job_id:
            raise ValueError("job_id is assigned by the server: send an empty job_id")
        if self.pp_degree * self.dp_degree * self.tp_degree != self.world_size:
            raise ValueError(f"world_size {self.world_size} is not pp x dp x tp = "
                             f"{self.pp_degree} x {self.dp_degree} x {self.tp_degree}")
        return self


class RankInfo(BaseModel):
    """One rank of a registered job, with its GPU's clocks."""

    rank: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    pp_rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    available_frequencies: list[Annotated[int, Field(gt=0)]] = Field(max_length=MAX_VALUES)


class FrequencySchedule(BaseModel):
    """One rank's clock per compute instruction of one step, in execution order."""

    rank: int = Field(ge=0)
    frequencies: list[tuple[str, int]]


class ProfilingResult(BaseModel):
    """What a rank measured running the schedules of a window of steps."""

    rank: int = Field(ge=0)
    iter_time: Values
    iter_energy: Values
    time_breakdown: Breakdown = {}
    energy_breakdown: Breakdown = {}

    @model_validator(mode="after")
    def _window(self) -> ProfilingResult:
        if len(self.iter_time) != len(self.iter_energy):
            raise ValueError(f"iter_time has {len(self.iter_time)} steps, iter_energy "
                             f"{len(self.iter_energy)}: one time and one energy per step")
        return self
