"""The parallel context: one validated object describing the (pp, dp, tp) layout of this job.

`init()` is the only place that touches process-global state: it initializes torch.distributed
when needed and remembers the context it built as the default for `get_context()`, so that old
Merak scripts calling `merak.init(dp, tp, pp)` keep working. Everything else in Merak takes the
context as an explicit argument.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp", "tp")

# The one piece of module-level state Merak keeps: the context built by the last `init()`.
_default_context: ParallelContext | None = None


@dataclass(frozen=True)
class ParallelContext:
    """Ranks, sizes and process groups of a (pp, dp, tp) job.

    Global ranks are laid out with tp innermost and pp outermost:
    ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``.
    """

    dp: int
    tp: int
    pp: int
    rank: int
    world_size: int
    backend: str
    device: torch.device
    mesh: DeviceMesh
    # what the user registered for this job, e.g. the TP plan of `merak.set_tp_layer_lists`
    settings: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def stage_id(self) -> int:
        """The pipeline stage this rank runs (same as `pp_rank`)."""
        return self.pp_rank

    @property
    def num_stages(self) -> int:
        return self.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    def rank_of(self, *, pp_rank: int | None = None, dp_rank: int | None = None,
                tp_rank: int | None = None) -> int:
        """Global rank at the given coordinates; omitted coordinates are this rank's own."""
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        if not (0 <= pp_rank < self.pp and 0 <= dp_rank < self.dp and 0 <= tp_rank < self.tp):
            raise ValueError(
                f"coordinates (pp={pp_rank}, dp={dp_rank}, tp={tp_rank}) are outside the "
                f"mesh (pp={self.pp}, dp={self.dp}, tp={self.tp})")
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def stage_rank(self, stage_id: int) -> int:
        """Global rank running `stage_id` in this rank's (dp, tp) pipeline."""
        return self.rank_of(pp_rank=stage_id)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} backend={self.backend} "
                f"pp={self.pp_rank}/{self.pp} dp={self.dp_rank}/{self.dp} "
                f"tp={self.tp_rank}/{self.tp}")


def _check_degrees(dp: int, tp: int, pp: int) -> None:
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"merak.init: {name} must be a positive int, got {value!r}")
        if value <= 0:
            raise ValueError(f"merak.init: {name} must be positive, got {name}={value}")


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # Launched without torchrun: a one-process group, so single-process runs use the same code.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=timeout)


def init(dp: int = 1, tp: int = 1, pp: int = 1, backend: str | None = None, *,
         timeout: datetime.timedelta | float = 600.0) -> ParallelContext:
    """Initialize torch.distributed (if needed) and build the (pp, dp, tp) device mesh.

    Args:
        dp: data-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree (number of stages).
        backend: torch.distributed backend; default ``nccl`` when CUDA is available, else ``gloo``.
            An explicit value is always honoured.
        timeout: collective timeout (seconds or timedelta) used when this call creates the
            process group.

    Returns:
        The `ParallelContext`; it also becomes the default returned by `get_context()`.

    Raises:
        ValueError: a degree is not a positive int, or dp * tp * pp differs from the world size.
    """
    global _default_context
    _check_degrees(dp, tp, pp)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if dist.is_initialized():
        if backend is not None and backend != dist.get_backend():
            raise ValueError(f"merak.init: backend={backend!r} was asked for, but torch.distributed "
                             f"is already initialized with {dist.get_backend()!r}; drop the "
                             f"backend argument or initialize with {backend!r}")
        backend = dist.get_backend()
    else:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        _init_process_group(backend, timeout)
    world_size = dist.get_world_size()
    if dp * tp * pp != world_size:
        raise ValueError(
            f"merak.init: dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp} but the world size "
            f"is {world_size}; choose degrees whose product is {world_size} or launch "
            f"{dp * tp * pp} processes (torchrun --nproc_per_node {dp * tp * pp})")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIM_NAMES)
    context = ParallelContext(dp=dp, tp=tp, pp=pp, rank=dist.get_rank(), world_size=world_size,
                              backend=backend, device=device, mesh=mesh)
    _default_context = context
    return context


def get_context() -> ParallelContext:
    """The context built by the last `merak.init()`."""
    if _default_context is None:
        raise RuntimeError("merak has no parallel context yet: call merak.init(dp=, tp=, pp=) first")
    return _default_context
