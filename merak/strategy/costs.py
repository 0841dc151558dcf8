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

from merak.strategy.cluster import Cluster, synchronize
from merak.strategy.shape import ModelShape

# AdamW reads weight, gradient and two moments and writes weight and moments, all fp32
ADAMW_BYTES_PER_PARAM = 4 * (4 + 3)
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
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
    """Measured on `device` from three probes of the HF model `config` builds:

    - the decoder alone (no embedding, head or loss: fed hidden states, its output summed) with
      one block and with ``1 + extra_blocks``: their difference over `extra_blocks` is one
      block (forward time, backward time, bytes its forward keeps for backward, by the
      activation meter; more than one block in the difference steadies a small block's
      times); the larger one's AdamW step over the parameters it trains gives the optimizer's
      cost per parameter;
    - the whole one-block causal LM: less one block, it is the rest (embedding, final norm,
      head, loss).

    Probes run one at a time, each freed (weights, gradients, optimizer state, outputs) before
    the next is built: a 70B model's three-block probe with AdamW needs about 40 GB alone. The
    head's full-vocabulary logits (the largest activation of a small model) live only in the
    third probe, where they are what is measured; the decoder probes never compute them (their
    difference would cancel them anyway). The price: the probes' samples no longer alternate,
    so a change of conditions (a shared host's other work, clocks) between two probes shows in
    the difference; each figure is the median of `repeats` samples of about `MIN_SAMPLE_S`.
    `together` runs before every sample (a barrier: every rank of a job then runs the same
    work at once, contending as in training)."""
    import torch

    one = _measured(_Probe(config, 1, rows, seq, device, dtype), repeats, together)
    more = _measured(_Probe(config, 1 + extra_blocks, rows, seq, device, dtype), repeats,
                     together, step=True)
    whole = _measured(_Probe(config, 1, rows, seq, device, dtype, with_head=True), repeats,
                      together)
    block = [max(b - a, 0.0) / extra_blocks for a, b in zip(one, more)]
    head = [max(a - b, 0.0) for a, b in zip(whole, block)]
    element = torch.finfo(dtype).bits // 8 if dtype is not None else 4
    shape = ModelShape.from_config(config)
    return BlockCosts(rows, seq, block[0], block[1], block[2],
                      shape.boundary_bytes(rows, seq, element), head[0], head[1], head[2],
                      element, more[3])


def _measured(probe: _Probe, repeats: int, together: Callable[[], None] | None,
              step: bool = False) -> list[float]:
    """[forward s, backward s, bytes kept, optimizer step s per parameter (with `step`, else
    0)] of `probe`, which is freed before this returns (`_Probe.close`)."""
    try:
        forward = _median(probe.device, probe.forward, repeats, together)
        both = _median(probe.device, probe.forward_backward, repeats, together)
        kept = probe.kept()
        per_param = 0.0
        if step:
            probe.add_optimizer()
            per_param = _median(probe.device, probe.step, repeats, together) / probe.trained()
        return [forward, max(both - forward, 0.0), kept, per_param]
    finally:
        probe.close()


class _Probe:
    """`config` cut to `layers` blocks, with what `measure_costs` times: the decoder alone fed
    hidden states (requiring gradients, as a pipeline stage's input does), or `with_head` the
    whole causal LM on token ids with its loss."""

    def __init__(self, config, layers: int, rows: int, seq: int, device, dtype,
                 with_head: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        cut = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers,
                                          "use_cache": False})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cut)  # built on the host, moved without head
        self.model = (model if with_head else model.base_model).to(device).train()
        del model
        self.with_head, self.device, self.dtype = with_head, device, dtype
        self.optimizer = None
        if with_head:
            self.inputs = {"input_ids": torch.randint(0, cut.vocab_size, (rows, seq),
                                                      device=device)}
            self.inputs["labels"] = self.inputs["input_ids"]
        else:
            hidden = torch.randn(rows, seq, cut.hidden_size, device=device) * 0.02
            self.inputs = {"inputs_embeds": hidden.requires_grad_()}

    def loss(self):
        import torch

        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            out = self.model(**self.inputs)
            return out.loss if self.with_head else out[0].sum()

    def forward(self) -> None:
        self.loss()

    def forward_backward(self) -> None:
        self.loss().backward()

    def add_optimizer(self) -> None:
        import torch

        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> None:
        self.optimizer.step()

    def trained(self) -> int:
        """Parameters the optimizer steps: those with gradients (the decoder's unused
        embedding has none, so AdamW skips it)."""
        return sum(p.numel() for p in self.model.parameters() if p.grad is not None)

    def kept(self) -> float:
        """Bytes the forward keeps for backward (the activation meter)."""
        from merak.recompute.meter import ActivationMeter

        meter = ActivationMeter(list(self.model.parameters()) + list(self.model.buffers()))
        with meter.recording():
            loss = self.loss()
        del loss
        return float(meter.peak)

    def close(self) -> None:
        """Free the model, its gradients, the optimizer's state and the inputs now (and the
        device's cached blocks), not when the last reference happens to go: the next probe
        is built right after."""
        import gc

        import torch

        if self.optimizer is not None:
            self.optimizer.state.clear()
        self.model.zero_grad(set_to_none=True)
        self.model = self.optimizer = self.inputs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _median(device, run: Callable[[], None], repeats: int,
            together: Callable[[], None] | None) -> float:
    """Seconds of one call of `run`: the median of `repeats` samples, each repeating `run` for
    about `MIN_SAMPLE_S` (a run far shorter than the OS's time slice can catch a moment with a
    core to itself, which ranks sharing cores do not have while they train)."""
    # a warm-up call, which also sizes the samples
    inner = max(1, math.ceil(MIN_SAMPLE_S / max(_timed(device, run), 1e-9)))
    return statistics.median(_timed(device, run, inner, together) for _ in range(repeats))


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


def stage_blocks(layers: int, stages: int) -> list[int]:
    """Blocks per stage, as even as possible (the earlier stages take the remainder)."""
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def state_bytes(params: float, zero: int, dp: int, largest_block: float) -> float:
    """Bytes of one rank's model states for `params` parameters (its tp share) under `zero`.

    Merak's ZeRO-2/3 are FSDP2 units that accumulate unsharded gradients over the step's
    micro-batches and reduce-scatter them in the tail; ZeRO-2 keeps the gathered weights
    through the step, ZeRO-3 one gathered unit (block) at a time."""
    weights, grads, adam = 4 * params, 4 * params, ADAM_STATE_BYTES * params
    if zero == 0:
        return weights + grads + adam
    if zero == 1:
        return weights + grads + adam / dp
    sharded = (weights + grads + adam) / dp
    if zero == 2:
        return sharded + weights + grads
    return sharded + grads + 2 * 4 * largest_block  # a block gathered, the next prefetched
