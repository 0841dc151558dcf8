"""The parallel context: one validated object describing the (pp, dp, cp, tp) layout of this job
(cp, context parallelism, is 1 unless asked for; the mesh then has no cp dimension).

`init()` is the only place that touches process-global state: it initializes torch.distributed
when needed and remembers the context it built as the default for `get_context()`, so that old
Merak scripts calling `merak.init(dp, tp, pp)` keep working. Everything else in Merak takes the
context as an explicit argument.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from merak.distributed import attempt_store, gloo_interface, liveness, timeouts
from merak.distributed.backends import is_nccl as _is_nccl
from merak.distributed.backends import make_host_groups
from merak.distributed.expert_groups import check_ep, make_expert_groups

MESH_DIM_NAMES = ("pp", "dp", "tp")
CP_MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")  # with context parallelism (cp > 1)

# The one piece of module-level state Merak keeps here: the context built by the last `init()`
# (the job's timeout is `merak.distributed.timeouts`').
_default_context: ParallelContext | None = None


@dataclass(frozen=True)
class ParallelContext:
    """Ranks, sizes and process groups of a (pp, dp, cp, tp) job.

    Global ranks are laid out with tp innermost, then cp, dp, and pp outermost:
    ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank`` (with cp = 1, the
    (pp, dp, tp) layout ``(pp_rank * dp + dp_rank) * tp + tp_rank``). The cp ranks of a group
    read the same rows and hold the same weights: gradients are reduced over dp x cp (the
    `replica_group`).
    """

    dp: int
    tp: int
    pp: int
    rank: int
    world_size: int
    backend: str
    device: torch.device
    mesh: DeviceMesh
    # this rank's groups for host (CPU) tensors, by mesh dimension and "world" (`host_group`)
    host_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, compare=False,
                                                       repr=False)
    cp: int = 1  # context-parallel degree: each row's sequence split over cp ranks
    # dp x cp flattened (cp > 1), kept here: torch deprecates slicing it from the root mesh
    dp_cp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    ep: int = 1  # expert-parallel degree: carved from the dp x cp replicas (expert_groups)
    # (ep group, edp group) when ep > 1
    expert_groups: tuple | None = field(default=None, compare=False, repr=False)

    @property
    def ep_rank(self) -> int:
        return (self.dp_rank * self.cp + self.cp_rank) % self.ep

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The replicas splitting each MoE layer's experts (None when ep == 1)."""
        return self.expert_groups[0] if self.expert_groups else None

    @property
    def edp_group(self) -> dist.ProcessGroup:
        """The replicas holding the same experts (dp*cp/ep of them): expert gradients are
        reduced over it (the `replica_group` when ep == 1)."""
        return self.expert_groups[1] if self.expert_groups else self.replica_group

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights of a stage (and TP shard): dp x cp."""
        return self.dp * self.cp

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The ranks splitting this rank's rows (None when cp == 1)."""
        return self.mesh.get_group("cp") if self.cp > 1 else None

    @property
    def replica_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the `replicas` (the dp dimension, or dp x cp flattened): where
        gradients are averaged and ZeRO shards."""
        return self.dp_cp_mesh if self.cp > 1 else self.mesh["dp"]

    @property
    def replica_group(self) -> dist.ProcessGroup:
        return self.replica_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
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

    def host_group(self, dim: str = "world") -> dist.ProcessGroup:
        """This rank's group of mesh dimension `dim` ("pp", "dp", "tp") or of every rank
        ("world") for CPU tensors: the mesh's own groups where the backend moves CPU tensors
        (gloo), gloo groups made by `init` beside an NCCL job. Small exchanges that must not make
        the host wait for the device, and Python objects (`merak.distributed.host_objects`), go
        over them: torch's object collectives would stage every payload on the GPU."""
        if dim not in self.host_groups:
            raise ValueError(f"no host group {dim!r}; choose one of {sorted(self.host_groups)}")
        return self.host_groups[dim]

    def rank_of(self, *, pp_rank: int | None = None, dp_rank: int | None = None,
                tp_rank: int | None = None, cp_rank: int | None = None) -> int:
        """Global rank at the given coordinates; omitted coordinates are this rank's own."""
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        cp_rank = self.cp_rank if cp_rank is None else cp_rank
        if not (0 <= pp_rank < self.pp and 0 <= dp_rank < self.dp and 0 <= tp_rank < self.tp
                and 0 <= cp_rank < self.cp):
            raise ValueError(
                f"coordinates (pp={pp_rank}, dp={dp_rank}, cp={cp_rank}, tp={tp_rank}) are "
                f"outside the mesh (pp={self.pp}, dp={self.dp}, cp={self.cp}, tp={self.tp})")
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def timeout_s(self) -> float | None:
        """The job's timeout: how long any wait for other ranks lasts before it fails."""
        return liveness.job_timeout_s()

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} backend={self.backend} "
                f"pp={self.pp_rank}/{self.pp} dp={self.dp_rank}/{self.dp} "
                + (f"cp={self.cp_rank}/{self.cp} " if self.cp > 1 else "")
                + (f"ep={self.ep_rank}/{self.ep} " if self.ep > 1 else "")
                + f"tp={self.tp_rank}/{self.tp}")


def _check_degrees(dp: int, tp: int, pp: int, cp: int = 1) -> None:
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"merak.init: {name} must be a positive int, got {value!r}")
        if value <= 0:
            raise ValueError(f"merak.init: {name} must be positive, got {name}={value}")


def local_device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device a process with `local_rank` uses when it sees `device_count` devices:
    ``local_rank % device_count`` (a launcher that gives each process one GPU through
    CUDA_VISIBLE_DEVICES leaves every process device 0)."""
    if device_count < 1:
        raise RuntimeError(f"LOCAL_RANK {local_rank} needs a CUDA device, but none is visible; "
                           f"check CUDA_VISIBLE_DEVICES or use backend='gloo'")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {local_rank}")
    return local_rank % device_count


def process_group_timeout_s(device: torch.device) -> float | None:
    """The default process group's current timeout on `device` in seconds (every wait of the
    job ends after it), or None where the backend does not say."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(device)
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):  # a backend without options
        return None


def _join_existing(device: torch.device) -> None:
    """A group created before `init` without ``device_id`` starts NCCL lazily, and a pipeline's
    first operation would then be a point-to-point of a subset of the ranks (undefined in
    torch's docs): one all-reduce of every rank creates the communicator now."""
    dist.all_reduce(torch.zeros(1, device=device))


def _destroy_at_exit() -> None:
    """Tear the process group down before the interpreter exits: left to the destructors, a
    backend's threads can outlive it and abort the process ("terminate called without an
    active exception"), which torchrun reports as a failed job."""
    beacon = liveness.current()
    if beacon is not None:
        beacon.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def _create_group(backend: str, timeout: datetime.timedelta, device: torch.device) -> None:
    """The default process group, its creation bounded by `timeout` (every rank must join)."""
    try:
        _init_process_group(backend, timeout, device_id=device if _is_nccl(backend) else None)
    except (RuntimeError, ValueError) as error:
        if not liveness.is_peer_failure(error):
            raise
        world = os.environ.get("WORLD_SIZE", "?")
        raise liveness.PeerFailureError(
            f"merak.init: not all {world} ranks joined the process group within "
            f"{timeout.total_seconds():g} s (rank {os.environ.get('RANK', '?')}, store at "
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}). "
            f"Check that every rank was started (the launcher's log) and reaches that address, "
            f"or raise the timeout (merak.init(timeout=), ddp_timeout). "
            f"({str(error).strip().splitlines()[0][:200]})") from error


def _local_device(backend: str) -> torch.device:
    if not _is_nccl(backend):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_device_index(local_rank, torch.cuda.device_count()))


def _init_process_group(backend: str, timeout: datetime.timedelta,
                        device_id: torch.device | None = None) -> None:
    """`device_id` (NCCL): bind the group to this device, which makes NCCL create its
    communicator now rather than at the first collective. Under torchrun the group's store is
    this attempt's (`merak.distributed.attempt_store`): a restarted attempt starts clean."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        found = attempt_store.for_this_attempt(os.environ, timeout)
        given = {} if found is None else dict(zip(("store", "rank", "world_size"), found))
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id, **given)
        return
    # Launched without torchrun: a one-process group, so single-process runs use the same code.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=timeout, device_id=device_id)


def init(dp: int | None = None, tp: int | None = None, pp: int | None = None,
         backend: str | None = None, *, timeout: datetime.timedelta | float | None = None,
         cp: int | None = None, ep: int = 1) -> ParallelContext:
    """Initialize torch.distributed (if needed) and build the (pp, dp, cp, tp) device mesh.

    Args:
        dp: data-parallel degree. With no degree at all, every rank is data-parallel (dp =
            world size): the layout to start from when ``MerakArguments(auto_parallel=True)``
            plans the real one.
        tp: tensor-parallel degree (default 1 when any degree is given).
        pp: pipeline-parallel degree (number of stages; default 1 when any degree is given).
        backend: torch.distributed backend; default ``nccl`` when CUDA is available, else ``gloo``.
            An explicit value is always honoured.
        cp: context-parallel degree (default 1): each row's sequence is split over cp ranks
            (`merak.context_parallel`), which hold the same weights. With cp > 1 the mesh is
            (pp, dp, cp, tp), the rank layout is ``((pp_rank * dp + dp_rank) * cp + cp_rank) *
            tp + tp_rank``, and dp x cp is flattened into ``dp_cp`` (`replica_mesh`).
        timeout: the job's timeout (seconds or timedelta): how long creating the process
            group and every later wait for other ranks (collective, point-to-point, barrier)
            may last before it fails naming the ranks that did not arrive. Default: the
            timeout set before (`set_job_timeout`), else that of a group created earlier, else
            HF's ddp_timeout default, 1800 s. Given while a process group exists (made by HF's
            TrainingArguments or accelerate, with their own timeout), it replaces that group's
            timeout, with a warning when they differ. `MerakTrainer` then applies
            `MerakArguments.ddp_timeout` to every group: pass the same value here (the order:
            ``args = MerakArguments(...)``, ``merak.init(timeout=args.ddp_timeout)``, or
            ``merak.init`` first with the timeout you will give ``ddp_timeout``) so that the
            group's creation is bounded by it too.
        ep: expert-parallel degree (default 1): each MoE layer's experts are split over ep of
            a stage's dp x cp replicas (`merak.expert_parallel`); it adds no ranks and must
            divide dp * cp (checked before any group is made).

    With NCCL, this process uses CUDA device ``LOCAL_RANK % torch.cuda.device_count()`` (so a
    process that sees one GPU uses it whatever its local rank), made current before the process
    group is created with it as ``device_id`` (NCCL initializes eagerly); a group created
    earlier (by HF's TrainingArguments or accelerate) is joined with one all-reduce of every
    rank, so its communicator exists before any pipeline transfer. `init` also destroys the
    process group when the process exits.

    Returns:
        The `ParallelContext`; it also becomes the default returned by `get_context()`.

    Raises:
        ValueError: a degree is not a positive int, dp * cp * tp * pp differs from the world
            size, or ep does not divide dp * cp.
    """
    global _default_context
    if dp is None and tp is None and pp is None and cp is None:
        dp = dist.get_world_size() if dist.is_initialized() else \
            int(os.environ.get("WORLD_SIZE", "1"))
    dp, tp, pp, cp = (1 if d is None else d for d in (dp, tp, pp, cp))
    _check_degrees(dp, tp, pp, cp)
    check_ep(ep, dp, cp)
    explicit = timeout is not None
    if explicit:
        timeout = timeouts.given_to_init(timeout)
    if dist.is_initialized():
        if backend is not None and backend != dist.get_backend():
            raise ValueError(f"merak.init: backend={backend!r} was asked for, but "
                             f"torch.distributed is already initialized with "
                             f"{dist.get_backend()!r}; drop the backend argument or initialize "
                             f"with {backend!r}")
        backend = dist.get_backend()
    elif backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _local_device(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gloo_interface.ensure()  # a multi-node job: a routable interface for gloo, or a clear error
    if not dist.is_initialized():
        _create_group(backend, timeout or timeouts.for_a_new_group(), device)
    elif explicit:
        timeouts.replacing_existing(timeout)
    timeouts.set_job_timeout(timeout)  # (None: the one set before, else the existing group's)
    liveness.start(dist.get_rank(), dist.get_world_size())
    if dist.is_initialized() and _is_nccl(backend) and _default_context is None:
        with liveness.waiting("merak.init's first all-reduce (NCCL's communicator)"):
            _join_existing(device)
    atexit.unregister(_destroy_at_exit)  # once, however many times init runs
    atexit.register(_destroy_at_exit)
    world_size = dist.get_world_size()
    size = dp * cp * tp * pp
    if size != world_size:
        shown = f"dp * tp * pp = {dp} * {tp} * {pp}" if cp == 1 else \
            f"dp * cp * tp * pp = {dp} * {cp} * {tp} * {pp}"
        raise ValueError(
            f"merak.init: {shown} = {size} but the world size is {world_size}; choose degrees "
            f"whose product is {world_size} or launch {size} processes "
            f"(torchrun --nproc_per_node {size})")
    flat = None
    with liveness.waiting("creating the mesh's process groups (merak.init)"):
        if cp == 1:
            mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIM_NAMES)
        else:
            mesh = init_device_mesh(device.type, (pp, dp, cp, tp),
                                    mesh_dim_names=CP_MESH_DIM_NAMES)
            flat = mesh["dp", "cp"]._flatten("dp_cp")  # (torch's 1-D mesh of two dimensions)
        host_groups = make_host_groups(mesh, backend)
        experts = make_expert_groups(dp, tp, pp, cp, ep) if ep > 1 else None
    timeouts.set_job_timeout()  # the new groups too
    context = ParallelContext(dp=dp, tp=tp, pp=pp, rank=dist.get_rank(), world_size=world_size,
                              backend=backend, device=device, mesh=mesh,
                              host_groups=host_groups, cp=cp, dp_cp_mesh=flat, ep=ep,
                              expert_groups=experts)
    _default_context = context
    return context


def get_context() -> ParallelContext:
    """The context built by the last `merak.init()`."""
    if _default_context is None:
        raise RuntimeError("merak has no parallel context yet: "
                           "call merak.init(dp=, tp=, pp=) first")
    return _default_context


def default_context() -> ParallelContext | None:
    """The context built by the last `merak.init()`, or None before the first."""
    return _default_context


def restore_default_context(context: ParallelContext | None) -> None:
    """Make `context` (one `default_context()` returned earlier) the default again: a piece of
    work that built contexts of its own and destroyed their groups (a planner's dry runs,
    `merak.distributed.teardown`) hands the caller's back."""
    global _default_context
    _default_context = context
