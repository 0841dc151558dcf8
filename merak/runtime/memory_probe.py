"""Does a training step at this batch fit in device memory? Asked of every rank at once.

An out-of-memory error in the middle of a pipeline step cannot be recovered from: the rank that
fails stops posting its sends and receives, and its peers wait on them forever. So the question
is asked without communication in the part that may fail: after the shapes of the batch are
known (the interpreter's shape discovery, a collective forward without gradients), each rank
runs its own stages' share of a step alone, on zero tensors of the received shapes: as many
forwards as a 1F1B schedule keeps in flight on that stage (the peak of activations), then their
backwards. Every rank then learns, by one all-reduce, whether all of them fit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils.memory import should_reduce_batch_size


def fits_in_memory(engine, batch: dict[str, torch.Tensor] | None,
                   num_microbatches: int) -> bool:
    """Whether `engine` (a `PipelineInterpreter`) can train on `batch` (this rank's share) on
    every rank; a collective. Gradients, the optimizer and the random number generators are
    left as they were."""
    rng = engine.rng_state()
    fits = True
    try:
        engine._begin(batch, num_microbatches, None)  # noqa: SLF001 - the runtime's own probe
        for runner in engine.runners.values():
            _stage_alone(runner, engine.split.num_stages, num_microbatches)
    except Exception as error:  # noqa: BLE001 - only an out-of-memory error is an answer
        if not should_reduce_batch_size(error):
            raise
        fits = False
    finally:
        for runner in engine.runners.values():
            runner.end()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.set_rng_state(rng)
        if engine.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    answer = torch.tensor([int(fits)], device=engine.ctx.device)
    if engine.ctx.world_size > 1:
        dist.all_reduce(answer, op=dist.ReduceOp.MIN)
    return bool(answer.item())


def _stage_alone(runner, num_stages: int, num_microbatches: int) -> None:
    in_flight = min(num_microbatches, num_stages - runner.stage_id)
    device = runner.device
    for mb in range(in_flight):
        runner.load(mb)
        runner.receive(mb, {key: torch.zeros(shape, dtype=dtype, device=device)
                            .requires_grad_(dtype.is_floating_point)
                            for key, (shape, dtype) in runner.received_shapes.items()})
        runner.forward(mb)
    for mb in range(in_flight):
        if not runner.is_last:
            runner.receive_grads(mb, {key: torch.ones_like(value)
                                      for key, value in runner.outputs(mb).items()})
        if runner.recompute.active:
            runner.recompute_blocks(mb)
        runner.backward(mb)
