"""Does a training step at this batch fit in device memory? Asked of every rank at once.

An out-of-memory error in the middle of a pipeline step cannot be recovered from: the rank that
fails stops posting its sends and receives, and its peers wait on them forever. So the question
is asked without communication in the part that may fail: after the shapes of the batch are
known (the interpreter's shape discovery, a collective forward without gradients), each rank
runs its own stages' share of a step alone, on zero tensors of the received shapes: as many
forwards as a 1F1B schedule keeps in flight on that stage (the peak of activations), then their
backwards. Every rank then learns, by one all-reduce, whether all of them fit.

The optimizer's state is not there yet when the probe runs before training: AdamW allocates
its two moments at the first `step()`, and from the second step on they sit beside the
activations. So the probe holds a block the size of the state the optimizer has yet to allocate
(`pending_optimizer_state_bytes`) while its forwards and backwards run: a step that fits only
without the state is answered "does not fit", as the second training step would be.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils.memory import should_reduce_batch_size
from torch.distributed.optim import ZeroRedundancyOptimizer

from merak.distributed import liveness


def _tensors_per_param(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """How many tensors shaped like each parameter `optimizer` allocates at its first step for
    a parameter of `group`; an optimizer not named here counts as Adam's two (the usual
    choice, and as many as most keep)."""
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW"):
        return 2 + int(bool(group.get("amsgrad")))  # moments (+ the running max)
    if name == "SGD":
        return int(group.get("momentum", 0) != 0)
    if name == "RMSprop":
        return 1 + int(group.get("momentum", 0) > 0) + int(bool(group.get("centered")))
    if name == "Adagrad":
        return 0  # allocated by its constructor: already there
    if name == "ASGD":
        return 1
    return 2


def pending_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state `optimizer` will allocate at its next `step()` on this rank: for
    each trainable parameter it steps that has no state yet, its per-parameter tensors
    (AdamW: two, of the parameter's dtype, so 8 bytes per fp32 parameter). Under ZeRO-1 only
    this rank's shard (`ZeroRedundancyOptimizer`'s local optimizer); the per-parameter step
    counters (one element each) are left out."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    total = 0
    for group in local.param_groups:
        count = _tensors_per_param(local, group)
        for param in group["params"]:
            if param.requires_grad and not local.state.get(param):
                total += count * param.numel() * param.element_size()
    return total


def fits_in_memory(engine, batch: dict[str, torch.Tensor] | None,
                   num_microbatches: int) -> bool:
    """Whether `engine` (a `PipelineInterpreter`) can train on `batch` (this rank's share) on
    every rank; a collective. Gradients, the optimizer and the random number generators are
    left as they were. The optimizer state the first step will allocate is held aside while
    the stages run (see the module's docstring)."""
    rng = engine.rng_state()
    fits = True
    try:
        # the collective shape discovery: a failure there (out of memory included) is not an
        # answer but the job's error, raised on the rank it happens on; its peers, waiting in
        # the collective, name that rank. Caught, it would leave them waiting.
        engine._begin(batch, num_microbatches, None)  # noqa: SLF001 - the runtime's own probe
        fits = _fits_alone(engine, num_microbatches)  # from here on a rank may fail alone
    finally:
        for runner in engine.runners.values():
            runner.end()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.set_rng_state(rng)
        if engine.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    answer = torch.tensor([int(fits)], device=engine.ctx.device)
    if engine.ctx.world_size > 1:
        with liveness.waiting("auto_find_batch_size's agreement (every rank's probe)"):
            dist.all_reduce(answer, op=dist.ReduceOp.MIN)
    return bool(answer.item())


def _fits_alone(engine, num_microbatches: int) -> bool:
    """Whether this rank's stages run a step's share alone, the optimizer's pending state held
    aside (no communication: an out-of-memory error here is this rank's answer)."""
    reserve = None
    try:
        reserve = torch.empty(pending_optimizer_state_bytes(engine.optimizer),
                              dtype=torch.uint8, device=engine.ctx.device)
        for runner in engine.runners.values():
            _stage_alone(runner, engine.split.num_stages, num_microbatches)
    except Exception as error:  # noqa: BLE001 - only an out-of-memory error is an answer
        if not should_reduce_batch_size(error):
            raise
        return False
    finally:
        del reserve
    return True


def _stage_alone(runner, num_stages: int, num_microbatches: int) -> None:
    in_flight = min(num_microbatches, num_stages - runner.stage_id)
    device = runner.device
    for mb in range(in_flight):
        runner.load(mb)
        runner.receive(mb, {key: torch.zeros(shape, dtype=dtype, device=device)
                            .requires_grad_(dtype.is_floating_point)
                            for key, (shape, dtype) in runner.received_shapes.get(mb, {}).items()})
        runner.forward(mb)
    for mb in range(in_flight):
        if not runner.is_last:
            runner.receive_grads(mb, {key: torch.ones_like(value)
                                      for key, value in runner.outputs(mb).items()})
        if runner.recompute.active:
            runner.recompute_blocks(mb)
        runner.backward(mb)
