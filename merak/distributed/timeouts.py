"""One timeout for the whole job: every wait for other ranks (creating the process group,
collectives, point-to-point, barriers) lasts at most the user's timeout.

Its source is ``MerakArguments.ddp_timeout`` (HF's default, 1800 s), through
`merak.init(timeout=)` and `MerakTrainer`, which applies ``ddp_timeout`` to every group when it
is made. torch gives each group its own timeout, and a group made by `new_group` (the mesh's
dimensions, the host groups, tied-weight groups, a dry run's) gets torch's default (30 minutes),
not the world's: `set_job_timeout` sets the job's on every group this rank holds, and runs again
after anything makes groups (`merak.init`, `build_engine`).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import warnings

import torch.distributed as dist

from merak.distributed import liveness

HF_DEFAULT_TIMEOUT_S = 1800.0  # transformers' TrainingArguments.ddp_timeout default

# the timeout every group of the job waits at most (None until first set), and the one
# `merak.init` was given explicitly (to say so when MerakArguments.ddp_timeout differs)
_job_timeout: datetime.timedelta | None = None
_init_timeout: datetime.timedelta | None = None


def as_timedelta(timeout: datetime.timedelta | float) -> datetime.timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"merak: the timeout must be a positive number of seconds, got "
                         f"{timeout!r}")
    return datetime.timedelta(seconds=seconds)


def given_to_init(timeout: datetime.timedelta | float) -> datetime.timedelta:
    """`merak.init`'s explicit timeout, remembered (see `use_trainer_timeout`)."""
    global _init_timeout
    _init_timeout = as_timedelta(timeout)
    return _init_timeout


def for_a_new_group() -> datetime.timedelta:
    """The timeout of a process group `merak.init` creates without being given one."""
    return _job_timeout or datetime.timedelta(seconds=HF_DEFAULT_TIMEOUT_S)


def replacing_existing(timeout: datetime.timedelta) -> None:
    """Says so (rank 0) when `merak.init`'s timeout replaces another one of a group created
    before it (by HF's TrainingArguments, accelerate or the script)."""
    existing = liveness.job_timeout_s()
    if existing is not None and existing != timeout.total_seconds() and _job_timeout is None \
            and dist.get_rank() == 0:
        warnings.warn(f"merak.init(timeout={timeout.total_seconds():g}): the process group was "
                      f"created before (by HF's TrainingArguments, accelerate or the script) "
                      f"with a timeout of {existing:g} s; every group of the job now waits at "
                      f"most {timeout.total_seconds():g} s", stacklevel=4)


def set_job_timeout(timeout: datetime.timedelta | float | None = None) -> float:
    """Every process group of this rank waits at most `timeout` (seconds or timedelta; None:
    the job's timeout again, for the groups made since; before any, the default group's).
    Returns the timeout in seconds."""
    global _job_timeout
    if timeout is not None:
        _job_timeout = as_timedelta(timeout)
    if _job_timeout is None:
        _job_timeout = datetime.timedelta(seconds=liveness.job_timeout_s()
                                          or HF_DEFAULT_TIMEOUT_S)
    if dist.is_initialized():
        with warnings.catch_warnings():  # "only supported for nccl or gloo": nothing to set
            warnings.simplefilter("ignore")
            for group in list(dist.distributed_c10d._world.pg_map):
                with contextlib.suppress(ValueError, RuntimeError, AttributeError):
                    dist.distributed_c10d._set_pg_timeout(_job_timeout, group)
    return _job_timeout.total_seconds()


def use_trainer_timeout(seconds: float) -> None:
    """`MerakArguments.ddp_timeout` for every group of the job (`MerakTrainer` calls it). Left
    at HF's default (1800 s), it keeps a timeout `merak.init` was given explicitly; set to
    another value it wins, with a warning (rank 0) when `merak.init` was given another one."""
    if _init_timeout is not None and seconds == HF_DEFAULT_TIMEOUT_S:
        set_job_timeout()  # merak.init's, explicit
        return
    if _init_timeout is not None and _init_timeout.total_seconds() != seconds \
            and dist.is_initialized() and dist.get_rank() == 0:
        warnings.warn(f"merak.init(timeout={_init_timeout.total_seconds():g}) and "
                      f"MerakArguments.ddp_timeout={seconds:g} differ: every wait of the job "
                      f"now lasts at most ddp_timeout = {seconds:g} s (give merak.init the "
                      f"same timeout, or leave it out)", stacklevel=3)
    set_job_timeout(seconds)
