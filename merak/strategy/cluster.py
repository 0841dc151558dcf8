"""Where a plan runs: the devices and links of a cluster, and what collectives cost on them.

A `Cluster` is either described (offline planning: peak FLOP/s, memory, bandwidths, GPUs per
node; `CLUSTERS` holds common ones) or measured on the running job (`measure_links`, online
planning). Collective times follow the ring algorithms NCCL and gloo use: an all-reduce of B
bytes over n ranks moves 2 (n - 1) / n x B per rank, an all-gather or reduce-scatter half that;
each of the 2 (n - 1) (or n - 1) steps pays the latency once. A group whose ranks do not all
sit on one node runs at the inter-node bandwidth.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from merak.inputs import read_json

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    """A job's devices and links.

    Attributes:
        world_size: number of devices (one process each).
        gpus_per_node: devices per node (the rest of a group spans nodes).
        peak_flops: dense FLOP/s of one device in the training dtype.
        memory_bytes: memory one device may use.
        intra_bw: bytes/s one device sends within a node (bus bandwidth).
        inter_bw: bytes/s one device sends to another node.
        latency_s: the fixed cost of one transfer step.
        efficiency: the fraction of `peak_flops` a transformer block's matmuls reach (offline
            plans; measured plans time the blocks instead).
        memory_bw: bytes/s of one device's memory the optimizer step streams at (offline
            plans; measured plans time the step).
        name: a label for reports.
    """

    world_size: int
    gpus_per_node: int
    peak_flops: float
    memory_bytes: float
    intra_bw: float
    inter_bw: float
    latency_s: float = 5e-6
    efficiency: float = 0.5
    memory_bw: float = 2e12
    name: str = "cluster"

    def __post_init__(self):
        for field in ("world_size", "gpus_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{field} must be an integer >= 1, got {value!r}")
        for field in ("peak_flops", "memory_bytes", "intra_bw", "inter_bw", "memory_bw",
                      "latency_s", "efficiency"):
            value = getattr(self, field)
            positive = field != "latency_s"
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"Cluster.{field} must be a finite number "
                                 f"{'> 0' if positive else '>= 0'}, got {value!r}")
        if self.efficiency > 1:
            raise ValueError(f"Cluster.efficiency is a fraction of peak_flops in (0, 1], got "
                             f"{self.efficiency}")

    # -- groups of the (pp, dp, tp) mesh: tp innermost, then dp, then pp ----------------------
    def spans_nodes(self, size: int, stride: int) -> bool:
        """Whether a group of `size` ranks `stride` apart leaves one node (groups aligned on
        multiples of ``stride x size``, as the mesh makes them)."""
        return size > 1 and stride * size > self.gpus_per_node

    def bandwidth(self, size: int, stride: int) -> float:
        return self.inter_bw if self.spans_nodes(size, stride) else self.intra_bw

    def all_reduce_s(self, nbytes: float, size: int, stride: int = 1) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (size - 1)
        return steps / size * nbytes / self.bandwidth(size, stride) + steps * self.latency_s

    def all_gather_s(self, nbytes: float, size: int, stride: int = 1) -> float:
        """An all-gather (or reduce-scatter) whose whole result is `nbytes`."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        return (size - 1) / size * nbytes / self.bandwidth(size, stride) \
            + (size - 1) * self.latency_s

    def p2p_s(self, nbytes: float, size: int, stride: int) -> float:
        """One message between neighbours of a pipeline group (`size` ranks `stride` apart):
        at the inter-node bandwidth when the group spans nodes (its slowest hop)."""
        if size <= 1:
            return 0.0
        return nbytes / self.bandwidth(size, stride) + self.latency_s

    # -- files --------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Cluster:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown cluster fields {sorted(unknown)}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**data)


# Published figures (dense bf16 peak; bus bandwidths a little under the link rates, as
# nccl-tests measure them); memory leaves room for the CUDA context and the allocator's slack.
CLUSTERS = {
    "h100": Cluster(world_size=8, gpus_per_node=8, peak_flops=989e12, memory_bytes=76 * GIB,
                    intra_bw=360e9, inter_bw=45e9, latency_s=8e-6, efficiency=0.55,
                    memory_bw=3.35e12, name="H100 SXM, NVLink 4, 400 Gb/s InfiniBand per GPU"),
    "h200": Cluster(world_size=8, gpus_per_node=8, peak_flops=989e12, memory_bytes=135 * GIB,
                    intra_bw=360e9, inter_bw=45e9, latency_s=8e-6, efficiency=0.55,
                    memory_bw=4.8e12, name="H200 SXM, NVLink 4, 400 Gb/s InfiniBand per GPU"),
    "a100": Cluster(world_size=8, gpus_per_node=8, peak_flops=312e12, memory_bytes=76 * GIB,
                    intra_bw=230e9, inter_bw=22e9, latency_s=10e-6, efficiency=0.55,
                    memory_bw=2.0e12,
                    name="A100 SXM 80 GB, NVLink 3, 200 Gb/s InfiniBand per GPU"),
}


def cluster(spec: str, world_size: int | None = None) -> Cluster:
    """A preset name (`CLUSTERS`) or a JSON file of `Cluster` fields; `world_size` overrides."""
    if spec in CLUSTERS:
        found = CLUSTERS[spec]
    elif Path(spec).is_file():
        data = read_json(spec, "the cluster file")
        if not isinstance(data, dict):
            raise ValueError(f"the cluster file {spec} holds a {type(data).__name__}, not an "
                             f"object of merak.strategy.Cluster fields")
        found = Cluster.from_json(data)
    else:
        raise ValueError(f"unknown cluster {spec!r}: give one of {sorted(CLUSTERS)} or a JSON "
                         f"file with the fields of merak.strategy.Cluster")
    return replace(found, world_size=world_size) if world_size else found


def measure_links(ctx, memory_bytes: float, peak_flops: float, sizes=(2**16, 2**22),
                  repeats: int = 3) -> Cluster:
    """The running job as a `Cluster`: all-reduces of two sizes over the whole job fit the
    bandwidth and latency (every rank calls it; the slowest rank's figures are used). Nodes are
    told apart by ``LOCAL_WORLD_SIZE``."""
    import os

    import torch
    import torch.distributed as dist

    times = []
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // 4, device=ctx.device)
        dist.all_reduce(tensor)  # warm-up
        synchronize(ctx.device)
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        synchronize(ctx.device)
        times.append((time.perf_counter() - start) / repeats)
    slowest = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    (t_small, t_large), n = slowest.tolist(), ctx.world_size
    steps, factor = 2 * (n - 1), 2 * (n - 1) / n
    bandwidth = factor * (sizes[1] - sizes[0]) / max(t_large - t_small, 1e-9)
    latency = max(t_small - factor * sizes[0] / bandwidth, 0.0) / max(steps, 1)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    return Cluster(world_size=n, gpus_per_node=per_node, peak_flops=peak_flops,
                   memory_bytes=memory_bytes, intra_bw=bandwidth, inter_bw=bandwidth,
                   latency_s=latency, efficiency=1.0, name=f"measured ({ctx.device.type})")


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
