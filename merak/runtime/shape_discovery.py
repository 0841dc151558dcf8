"""The activation shapes of a step's micro-batches, found before the step's first transfer.

A receiver sizes its buffers before it posts a receive (`merak.runtime.p2p`). What the shapes
depend on is the step's batch-shape key (`batch_shape_key`): the input shapes of every
micro-batch on every rank of the pipeline that loads any (under ZeRO-3 on every rank of the job:
its forwards gather over the replicas, which must run the same ones), and whether gradients
are on. For a key not seen before, each shape class (micro-batches of equal input shapes on
every rank: all of them when the batch was cut into equal parts, several for padding-free
micro-batches of different flattened lengths) has its first micro-batch's forward run once
without gradients, its messages carrying only shapes (`discover_shapes`). A packed dataset
brings new shapes at almost every step, and then costs one such forward per micro-batch of each
step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merak.distributed.compat import all_gather_single
from merak.runtime.microbatches import Batch, shape_classes, shape_code
from merak.schedule.actions import ActionKind

K = ActionKind


def batch_shape_key(engine, parts: Sequence[Batch], used: int) -> tuple[tuple, list[int]]:
    """The step's batch-shape key and each micro-batch's shape class (`shape_classes`). The
    codes are exchanged as host tensors over the pipeline's host group
    (`ParallelContext.host_group`), so the host never waits for the device; every rank agrees
    on whether shapes must be discovered anew."""
    ctx = engine.ctx
    local = [shape_code(parts[mb] if mb < len(parts) else {}) for mb in range(used)]
    codes = torch.tensor(local, dtype=torch.int64)
    # ZeRO-3 all-gathers each unit in every forward, a discovery's too, over the replicas,
    # whose micro-batches differ (rows padded to their own length): every rank must then run
    # the same discovery forwards, so every rank's codes make the key, not only the pipeline's
    zero = getattr(engine, "zero", None)
    dim, ranks = ("world", ctx.world_size) if zero is not None and zero.zero_stage == 3 \
        else ("pp", ctx.pp)
    if ranks > 1:
        gathered = torch.zeros(ranks * used, dtype=torch.int64)
        engine.transfers.wait_collective(
            all_gather_single(gathered, codes, group=ctx.host_group(dim), async_op=True),
            f"the batch-shape exchange that starts every step (an all-gather over the "
            f"{'ranks' if dim == 'world' else 'pipeline ranks'})")
        codes = gathered
    table = codes.view(-1, used).numpy().tolist()  # host memory: no device read
    return (torch.is_grad_enabled(), *(c for row in table for c in row)), shape_classes(table)


def discover_shapes(engine, classes: Sequence[int]) -> None:
    """Run the forward of each shape class's first micro-batch, in eval mode and without
    gradients, through the one-micro-batch forward program with one transfer per group whose
    messages carry only shapes (`StageTransfers.send_shapes`); the random number generators are
    left as they were. Each runner's `received_shapes` then holds, per micro-batch, the shapes
    it receives."""
    rng = engine.rng_state()
    was_training = engine.stage.training
    engine.stage.eval()
    received: dict[int, dict[int, dict]] = {}  # stage -> class -> value key -> (shape, dtype)
    try:
        with torch.no_grad():
            for mb in sorted(set(classes)):
                for action in engine._discovery_program:
                    runner = engine.runners[action.stage_id]
                    if action.local:  # between two of this rank's stages: no metadata
                        if action.kind is K.RECV_ACT:
                            values = engine._handed[(action.message[:3], mb)]
                            received.setdefault(action.stage_id, {}).setdefault(mb, {}).update(
                                {k: (v.shape, v.dtype) for k, v in values.items()})
                        engine._hand_off(action, mb)
                    elif action.kind is K.SEND_ACT:
                        engine.transfers.send_shapes(action, runner.outputs(mb), mb)
                    elif action.kind is K.RECV_ACT:
                        values = engine.transfers.recv_shapes(action, mb)
                        received.setdefault(action.stage_id, {}).setdefault(mb, {}).update(
                            {k: (v.shape, v.dtype) for k, v in values.items()})
                        runner.receive(mb, values)
                    elif action.kind is K.LOAD:
                        runner.load(mb)
                    elif action.kind is K.FORWARD:
                        runner.forward(mb, with_loss=False)
    finally:
        engine.stage.train(was_training)
        engine.set_rng_state(rng)
        for runner in engine.runners.values():
            for mb in set(classes):
                runner.reset_microbatch(mb)
    for stage_id, runner in engine.runners.items():
        shapes = received.get(stage_id, {})
        runner.received_shapes = {mb: shapes.get(rep, {}) for mb, rep in enumerate(classes)}
