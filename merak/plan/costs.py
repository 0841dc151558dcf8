"""Per-block costs a plan is predicted from: forward and backward time, activation bytes, and
the optimizer step per parameter.

`analytic_costs` derives them from a `ModelShape` and a `Cluster` (offline plans: FLOPs over the
device's effective rate). `measure_costs` times one real block of the model on this rank's
device at each micro-batch size, and counts what its forward keeps with the activation meter
(online plans). Either way the planner scales them to a layout: compute and the split
activations divide by the tensor-parallel degree, and each block adds its tensor-parallel
all-reduces (two in the forward, two in the backward) from the cluster's link model.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from merak.plan.cluster import Cluster, synchronize
from merak.plan.shape import ModelShape

# AdamW reads weight, gradient and two moments and writes weight and moments, all fp32
ADAMW_BYTES_PER_PARAM = 4 * (4 + 3)
MIN_SAMPLE_S = 0.1  # each timed sample of a block measurement lasts about this long


@dataclass(frozen=True)
class BlockCosts:
    """One micro-batch of `rows` x `seq` tokens at tp = 1.

    Attributes:
        forward_s, backward_s: one block's forward, and its backward (input and weight
            gradients).
        activation_bytes: what one block's forward keeps for backward.
        boundary_bytes: one block's input: what a recomputed block keeps, a pipeline message.
        head_forward_s, head_backward_s: the LM head and loss (the embedding is negligible).
        head_activation_bytes: what the head and loss keep.
        dtype_bytes: bytes per activation element (2 with bf16 autocast).
        optimizer_s_per_param: the optimizer step (AdamW over fp32 weights) per parameter it
            steps.
    """

    rows: int
    seq: int
    forward_s: float
    backward_s: float
    activation_bytes: float
    boundary_bytes: float
    head_forward_s: float
    head_backward_s: float
    head_activation_bytes: float
    dtype_bytes: int = 2
    optimizer_s_per_param: float = 0.0


def analytic_costs(shape: ModelShape, cluster: Cluster, rows: int, seq: int,
                   dtype_bytes: int = 2) -> BlockCosts:
    """Block and head times from FLOPs at ``peak_flops x efficiency``; a backward costs twice
    its forward (input and weight gradients, one matmul each). The optimizer step streams
    `ADAMW_BYTES_PER_PARAM` through the device's memory."""
    rate = cluster.peak_flops * cluster.efficiency
    forward = shape.block_flops(rows, seq) / rate
    head = shape.head_flops(rows, seq) / rate
    return BlockCosts(rows, seq, forward, 2 * forward,
                      shape.block_activation_bytes(rows, seq, 1, dtype_bytes),
                      shape.boundary_bytes(rows, seq, dtype_bytes), head, 2 * head,
                      shape.head_activation_bytes(rows, seq), dtype_bytes,
                      ADAMW_BYTES_PER_PARAM / cluster.memory_bw)


def measure_costs(config, rows: int, seq: int, device, dtype=None, repeats: int = 5,
                  extra_blocks: int = 2, together: Callable[[], None] | None = None
                  ) -> BlockCosts:
    """Measured on `device`: the HF model `config` builds, with one decoder block and with
    ``1 + extra_blocks``; their difference over `extra_blocks` is one block (forward time,
    backward time, bytes its forward keeps for backward, by the activation meter; more than one
    block in the difference steadies a small block's times), the one-block model less one block
    is the rest (embedding, head, loss); the larger model's AdamW step over its parameters
    gives the optimizer's cost per parameter.

    The two models' samples alternate, and each figure is the median of `repeats` samples of
    about `MIN_SAMPLE_S`: both models then see the same conditions (a shared host's other work,
    clock changes), which a difference of two small times is sensitive to. `together` runs
    before every sample (a barrier: every rank of a job then runs the same work at once,
    contending as in training)."""
    import torch

    probes = [_Probe(config, n, rows, seq, device, dtype) for n in (1, 1 + extra_blocks)]
    times = {}
    for phase in ("forward", "forward_backward", "step"):
        runs = [getattr(probe, phase) for probe in probes]
        times[phase] = _alternating(device, runs, repeats, together)
    one, more = ([f, max(fb - f, 0.0), probe.kept()] for f, fb, probe in
                 zip(times["forward"], times["forward_backward"], probes))
    step_per_param = times["step"][1] / probes[1].params
    del probes
    block = [max(b - a, 0.0) / extra_blocks for a, b in zip(one, more)]
    head = [max(a - b, 0.0) for a, b in zip(one, block)]
    element = torch.finfo(dtype).bits // 8 if dtype is not None else 4
    shape = ModelShape.from_config(config)
    return BlockCosts(rows, seq, block[0], block[1], block[2],
                      shape.boundary_bytes(rows, seq, element), head[0], head[1], head[2],
                      element, step_per_param)


class _Probe:
    """`config` cut to `layers` blocks, with what `measure_costs` times."""

    def __init__(self, config, layers: int, rows: int, seq: int, device, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        cut = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers,
                                          "use_cache": False})
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(cut).to(device).train()
        self.ids = torch.randint(0, cut.vocab_size, (rows, seq), device=device)
        self.device, self.dtype = device, dtype
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.params = sum(p.numel() for p in self.model.parameters())

    def loss(self):
        import torch

        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.model(input_ids=self.ids, labels=self.ids).loss

    def forward(self) -> None:
        self.loss()

    def forward_backward(self) -> None:
        self.loss().backward()

    def step(self) -> None:
        self.optimizer.step()

    def kept(self) -> float:
        """Bytes the forward keeps for backward (the activation meter)."""
        from merak.recompute.meter import ActivationMeter

        meter = ActivationMeter(list(self.model.parameters()) + list(self.model.buffers()))
        with meter.recording():
            loss = self.loss()
        del loss
        return float(meter.peak)


def _alternating(device, runs: list[Callable[[], None]], repeats: int,
                 together: Callable[[], None] | None) -> list[float]:
    """Seconds of one call of each of `runs`: the median of `repeats` samples, the runs'
    samples alternating, each sample repeating its run for about `MIN_SAMPLE_S` (a run far
    shorter than the OS's time slice can catch a moment with a core to itself, which ranks
    sharing cores do not have while they train)."""
    # a warm-up call, which also sizes the samples
    inner = [max(1, math.ceil(MIN_SAMPLE_S / max(_timed(device, run), 1e-9))) for run in runs]
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, count, found in zip(runs, inner, samples):
            found.append(_timed(device, run, count, together))
    return [statistics.median(found) for found in samples]


def fastest(device, run, repeats: int, together: Callable[[], None] | None = None) -> float:
    """Seconds of the fastest of `repeats` runs after one warm-up run (the least disturbed by
    other work), the device synchronised around each; `together` runs before each (a barrier
    lines up the ranks of a job)."""
    run()
    return min(_timed(device, run, 1, together) for _ in range(repeats))


def _timed(device, run: Callable[[], None], count: int = 1,
           together: Callable[[], None] | None = None) -> float:
    """Seconds per call of `count` calls of `run`, the device synchronised around them;
    `together` runs first, untimed."""
    synchronize(device)
    if together is not None:
        together()
    start = time.perf_counter()
    for _ in range(count):
        run()
    synchronize(device)
    return (time.perf_counter() - start) / count
