"""The one pipeline interpreter: walks this rank's program of a `Schedule`, whatever stages the
rank hosts (one for GPipe, 1F1B, Merak's and zero-bubble schedules; v model chunks for
interleaved 1F1B, two in a V for ZB-V and DualPipeV), wherever the schedule places them.

Each local stage has a `StageRunner` (its micro-batch values and compute handlers). The
interpreter dispatches every compute action to its stage's runner, posts every group of sends
and receives through `StageTransfers` (NCCL's rules), calls the instruction hooks around each
action, and runs the per-step tail once: tied weights summed across ranks, one data-parallel
all-reduce over all its stages' gradients, one optimizer step. A transfer between two of its
own stages (the turn of a V) is a local hand-off (`_hand_off`): no process group sees it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from merak.data_parallel.grad_sync import GradientAverager
from merak.data_parallel.shards import is_sharded
from merak.data_parallel.zero import ZeroSharding
from merak.distributed import liveness
from merak.options import given
from merak.recompute.blocks import BlockRecomputation
from merak.recompute.meter import ActivationMeter
from merak.runtime.cpu_threads import IdleCoreLending
from merak.runtime.forward_only import ForwardOnly
from merak.runtime.hooks import InstructionHook
from merak.runtime.microbatches import step_microbatches
from merak.runtime.options import RuntimeOptions
from merak.runtime.p2p import StageTransfers
from merak.runtime.program import forward_program, training_schedule
from merak.runtime.runner import OutputLoss, StageRunner
from merak.runtime.shape_discovery import batch_shape_key, discover_shapes
from merak.runtime.step_tail import (
    StepTail,
    last_weight_backwards,
    step_loss,
    tied_parameter_groups,
)
from merak.schedule.actions import Action, ActionKind, Schedule, stages_of
from merak.schedule.registry import placement_of
from merak.stages.stage import InterleavedStage, PipelineStage, block_names

K = ActionKind


class PipelineInterpreter(ForwardOnly, StepTail):
    """Executes this rank's program, one training step per `train_step()` call.

    Args:
        stage: this rank's stage (`PipelineStage`), or its model chunks (`InterleavedStage`,
            or the `PipelineStage`s of the stages the schedule places on this rank, in model
            order) for schedules that place several stages on a rank.
        ctx: the parallel context.
        optimizer: built over ``stage.parameters()``.
        options: the runtime's options (`RuntimeOptions`: schedule, num_microbatches,
            gradient reduction, recomputation, activation memory), or its fields by name
            (``num_microbatches=4, schedule="zbv"``).
        autocast_dtype: run forwards under `torch.autocast` to this dtype (mixed precision;
            parameters, gradients and optimizer state stay fp32).
        hooks: `InstructionHook`s called around every action.
        tp_rng: the model's `TPRandomState`, replayed by recomputation with the default RNG.
        zero: the stage's ZeRO-2/3 sharding (`shard_stage`, applied before the optimizer was
            built): its gradients are reduce-scattered by FSDP instead of all-reduced.
    """

    def __init__(self, stage: PipelineStage | InterleavedStage | Sequence[PipelineStage],
                 ctx, optimizer: torch.optim.Optimizer, options: RuntimeOptions | None = None,
                 *, autocast_dtype: torch.dtype | None = None,
                 hooks: Sequence[InstructionHook] = (), tp_rng: object = None,
                 zero: ZeroSharding | None = None, **fields):
        o = given(RuntimeOptions, options, fields, "PipelineInterpreter")
        schedule = o.schedule
        if not isinstance(stage, (PipelineStage, InterleavedStage)):
            stage = InterleavedStage(list(stage))
        self.stage = stage
        stages = stage.stages if isinstance(stage, InterleavedStage) else [stage]
        split, p = stages[0].split, ctx.pp
        v = len(stages)
        self.placement = placement_of(schedule, p, v)
        built_for = getattr(stage, "placement", None)
        if built_for is not None and tuple(built_for) != self.placement:
            raise ValueError(f"the stages were built for ranks {list(built_for)}, but schedule "
                             f"{getattr(schedule, 'name', schedule)!r} places them on "
                             f"{list(self.placement)}; build the stage with "
                             f"merak.parallelize(..., schedule=...)")
        expected = stages_of(self.placement, ctx.pp_rank)
        if split.num_stages != p * v or [s.stage_id for s in stages] != expected:
            raise ValueError(f"rank {ctx.rank} (pp rank {ctx.pp_rank}) must hold stages "
                             f"{expected} of a split into pp * model chunks = {p * v} stages; "
                             f"got stages {[s.stage_id for s in stages]} of {split.num_stages}")
        self.ctx, self.optimizer, self.split = ctx, optimizer, split
        self.stages_per_rank = v
        self._handed: dict[tuple, dict] = {}  # local hand-offs sent, not yet received
        self.num_microbatches = o.num_microbatches
        self.hooks = list(hooks)
        self.autocast_dtype, self.tp_rng = autocast_dtype, tp_rng
        self.loss_scale = 1.0  # set by an fp16 loss scaler
        # a training step's loss: the micro-batch losses times this, summed (HF's token-
        # weighted loss: each is already divided by the step's token count); None: their mean
        self.loss_weight: float | None = None
        self.skip_optimizer_step = False  # set before the step by a hook (fp16 overflow)
        self.kept: torch.Tensor | None = None  # eval outputs kept (predict)
        self.activation_peak: int | None = None
        self.global_step = 0
        single_host = os.environ.get("LOCAL_WORLD_SIZE", "1") == str(ctx.world_size)
        self._lend = o.lend_idle_cores and ctx.device.type == "cpu" and single_host and p > 1
        self._measure = o.measure_activations
        self.recompute_in_backward = o.recompute_in_backward
        self._blocks = {s.stage_id: [s.get_submodule(n) for n in block_names(split, s.stage_id)]
                        for s in stages}
        self.runners = {s.stage_id: StageRunner(s, BlockRecomputation([], [], ctx.device))
                        for s in stages}
        for s in stages if o.dealloc_outputs else ():
            self.runners[s.stage_id].freeable = s.freeable_outputs()
        self.transfers = StageTransfers(ctx, split)
        self.batch_keys = list(dict.fromkeys(k for r in self.runners.values()
                                             for k in r.batch_keys))
        params = list({id(q): q for q in stage.parameters()}.values())
        self.zero = zero
        # replicated parameters that saw only this TP rank's heads or sequence shard
        self._tp_partial = [q for q in params
                            if q.requires_grad and getattr(q, "tp_partial_grad", False)]
        self._tied = tied_parameter_groups(ctx, split, {i: r.stage for i, r in
                                                        self.runners.items()}, self.placement)
        # expert-parallel experts (merak.expert_parallel): their gradients already hold the
        # whole ep group's tokens; summed over edp in the step's tail (`_reduce_grads`), or by
        # ZeRO-2/3's reduce-scatter over edp where they are sharded
        self._experts = [q for q in params if q.requires_grad and not is_sharded(q)
                         and getattr(q, "expert_parallel", False)]
        self.grad_averager = GradientAverager(
            [q for q in params if not is_sharded(q) and not getattr(q, "expert_parallel", False)],
            ctx.replica_group, o.bucket_bytes,
            o.grad_predivide, late=self._tp_partial + [q for _, g in self._tied for q in g],
            stages={s: list(r.stage.parameters()) for s, r in self.runners.items()})
        self._discovery_program = forward_program(split, p, ctx.pp_rank, v, 1,
                                                  single_transfers=True,
                                                  placement=self.placement)
        self._schedule_spec = schedule
        self.set_recomputation(o.recompute_ratio, o.segment_size)

    # -- set-up -------------------------------------------------------------------------------
    def set_recomputation(self, ratio: float | Sequence[float], segment_size: int = 1,
                          schedule: str | Schedule | None = None) -> None:
        """(Re)build the schedule (`schedule`, or the current one) and the block recomputation
        for per-stage `ratio` (see the class doc); every rank calls it alike, between steps."""
        self._schedule_spec = schedule = schedule or self._schedule_spec
        schedule, segments = training_schedule(schedule, self.split, self.ctx.pp,
                                               self.stages_per_rank, self.num_microbatches,
                                               ratio, segment_size, self.placement)
        self.segments, self.schedule = segments, schedule
        self.program: list[Action] = list(schedule.programs[self.ctx.pp_rank])
        self._closing = last_weight_backwards(self.program)  # gradients final after these
        self._install_recomputation({s: segments[s] for s in self.runners})
        self.hooks = [h for h in self.hooks if not isinstance(h, IdleCoreLending)]
        if self._lend:  # (the interpreter's own hook: it follows the schedule)
            ctx = self.ctx
            self.hooks.insert(0, IdleCoreLending(schedule, ctx.pp_rank, ctx.replicas * ctx.tp))

    def _install_recomputation(self, segments: dict[int, Sequence[Sequence[int]]],
                               measure: str | None = None) -> None:
        """Wrap each local stage's recomputed blocks; `measure` "rank" (one meter: the rank's
        peak, whatever stages it hosts; the default with `measure_activations`) or "stage"
        (one meter per stage)."""
        measure = measure or ("rank" if self._measure else None)
        excluded = list(self.stage.parameters()) + list(self.stage.buffers())
        shared = ActivationMeter(excluded) if measure == "rank" else None
        for stage_id, runner in self.runners.items():
            runner.recompute.remove()
            runner.meter = ActivationMeter(excluded) if measure == "stage" else shared
            runner.recompute = BlockRecomputation(self._blocks[stage_id], segments[stage_id],
                                                  self.ctx.device, self.tp_rng, runner.meter,
                                                  self.recompute_in_backward)

    def remove_recomputation(self) -> None:
        """Give every recomputed block its own forward back."""
        for runner in self.runners.values():
            runner.recompute.remove()

    def attach_loss(self, loss: OutputLoss) -> None:
        """The last stage computes its loss eagerly from the split's output (e.g. the logits):
        ``loss(output, inputs)``, `inputs` the micro-batch's values named in
        ``loss.input_names``, which the rank holding the last stage then reads from the batch.
        Every rank calls it alike, before the first step."""
        last = self.runners.get(self.split.num_stages - 1)
        if last is not None:
            last.attach_loss(loss)
            self.batch_keys = list(dict.fromkeys([*self.batch_keys, *last.batch_keys]))

    def rng_state(self) -> tuple:
        return next(iter(self.runners.values())).recompute.rng_state()

    def set_rng_state(self, state: tuple) -> None:
        next(iter(self.runners.values())).recompute.set_rng_state(state)

    # -- steps --------------------------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor] | Sequence[dict] | None) -> float:
        """Run one optimizer step over `batch` (this dp rank's share of the global batch): one
        dict cut into the micro-batches, or the micro-batches themselves, collated one by one
        (`merak.runtime.microbatches`).

        Stages that read no batch input may pass None. Returns the step's loss (mean over
        micro-batches and dp ranks), on every rank.
        """
        meter = next(iter(self.runners.values())).meter
        if meter is not None:
            meter.reset_peak()
        self.grad_averager.begin_step()
        with liveness.waiting(f"training step {self.global_step + 1}"):
            loss = self._run(self.program, batch, self.num_microbatches, self.hooks,
                             loss_weight=self.loss_weight)
        if meter is not None:
            self.activation_peak = meter.peak
        self.global_step += 1
        return loss

    # -- the walk -----------------------------------------------------------------------------
    def _run(self, program: Sequence[Action], batch: dict[str, torch.Tensor] | None,
             num_microbatches: int, hooks: Sequence[InstructionHook],
             microbatches_used: int | None = None, loss_weight: float | None = None) -> float:
        self._begin(batch, num_microbatches, microbatches_used, loss_weight)
        for hook in hooks:
            hook.on_step_begin(self.global_step)
        index = 0
        while index < len(program):
            action = program[index]
            liveness.mark(action)  # (two attribute writes: what a peer is told this rank does)
            if action.group is None:
                self._execute(action, hooks)
                index += 1
                continue
            end = index
            while end < len(program) and program[end].group == action.group:
                end += 1
            self._communicate(program[index:end], hooks)
            index = end
        liveness.mark("the end of the step's sends")
        self.transfers.finish_step()
        losses = [loss for r in self.runners.values() for loss in r.losses]
        with liveness.waiting("the step's loss all-reduce"):
            loss = step_loss(self.ctx, losses, loss_weight)
        for hook in hooks:
            hook.on_step_end(self.global_step)
        for runner in self.runners.values():
            runner.end()
        return loss

    def _begin(self, batch: dict[str, torch.Tensor] | Sequence[dict] | None,
               num_microbatches: int, microbatches_used: int | None,
               loss_weight: float | None = None) -> None:
        if self.batch_keys and batch is None:
            raise ValueError(f"rank {self.ctx.rank} reads {self.batch_keys} from the batch "
                             f"but got batch=None")
        parts = step_microbatches(batch if batch is not None else {}, num_microbatches,
                                  self.batch_keys if batch is not None else [])
        parts = [{k: self._to_device(t) for k, t in part.items()} for part in parts]
        used = microbatches_used or num_microbatches
        for runner in self.runners.values():
            runner.device, runner.autocast_dtype = self.ctx.device, self.autocast_dtype
            # cp ranks' losses are shares of their rows' loss: times cp, the average over
            # the dp x cp replicas sums over cp (and averages over dp)
            runner.loss_scale = self.loss_scale * self.ctx.cp
            runner.loss_weight = loss_weight
            runner.begin([{k: part[k] for k in runner.batch_keys} for part in parts], used)
        if self.split.edges:
            key, classes = batch_shape_key(self, parts, used)
            if not self.transfers.shapes_known(key, classes):
                discover_shapes(self, classes)
                self.transfers.remember_shapes(key)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """To the device once, pinned and asynchronous on CUDA."""
        if not torch.is_tensor(tensor):
            return tensor
        if self.ctx.device.type == "cuda" and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.ctx.device, non_blocking=True)
        return tensor.to(self.ctx.device)

    def _execute(self, action: Action, hooks: Sequence[InstructionHook]) -> None:
        for hook in hooks:
            hook.on_instruction_begin(action.name, action)
        if action.stage_id is None:
            {K.REDUCE_TIED_GRADS: self._reduce_tied_grads, K.REDUCE_GRADS: self._reduce_grads,
             K.OPTIMIZER_STEP: self._optimizer_step}[action.kind]()
        elif action.local:
            self._hand_off(action, action.microbatch_id)
        else:
            runner, mb = self.runners[action.stage_id], action.microbatch_id
            closing = self._closing.get(action.stage_id) == action  # gradient sums may start
            with self._gradients_final(action) if closing else nullcontext():
                {K.LOAD: runner.load, K.FORWARD: runner.forward, K.BACKWARD: runner.backward,
                 K.RECOMPUTE: runner.recompute_blocks, K.BACKWARD_INPUT: runner.backward_input,
                 K.BACKWARD_WEIGHT: runner.backward_weight}[action.kind](mb)
        for hook in hooks:
            hook.on_instruction_end(action.name, action)

    def _hand_off(self, action: Action, mb: int) -> None:
        """A transfer between two of this rank's stages: the values of the edge move in memory
        (for micro-batch `mb`), activations detached with the sender's requires-grad flags as a
        receive makes them, so each stage's backward stays its own and the gradient comes back
        the same way. The sender keeps its outputs (the receiver shares their storage)."""
        _, src, dst, _ = action.message
        keys = self.split.transfers[(src, dst)]
        runner = self.runners[action.stage_id]
        key = (action.message[:3], mb)
        if action.kind is K.SEND_ACT:
            outputs = runner.outputs(mb)
            self._handed[key] = {k: outputs[k].detach().requires_grad_(outputs[k].requires_grad)
                                 for k in keys}
            if not torch.is_grad_enabled():  # evaluation: nothing waits for a backward
                runner.sent(mb, False, dst)
        elif action.kind is K.SEND_GRAD:
            grads = runner.input_grads(mb)
            self._handed[key] = {k: grads.pop(k) for k in keys if k in grads}
        elif action.kind is K.RECV_ACT:
            runner.receive(mb, self._handed.pop(key))
        else:
            runner.receive_grads(mb, self._handed.pop(key))

    def _communicate(self, group: Sequence[Action], hooks: Sequence[InstructionHook]) -> None:
        """Post one group of sends and receives and hand what arrived to the runners."""
        for action in group:
            for hook in hooks:
                hook.on_instruction_begin(action.name, action)

        def outgoing(action: Action) -> dict:
            runner = self.runners[action.stage_id]
            if action.kind is K.SEND_ACT:
                return runner.outputs(action.microbatch_id)
            return runner.input_grads(action.microbatch_id)

        received = self.transfers.run_group(group, outgoing)
        for action, values in received.items():
            runner = self.runners[action.stage_id]
            if action.kind is K.RECV_ACT:
                runner.receive(action.microbatch_id, values)
            else:
                runner.receive_grads(action.microbatch_id, values)
        for action in group:
            if action.kind in (K.SEND_ACT, K.SEND_GRAD):
                self.runners[action.stage_id].sent(
                    action.microbatch_id, action.kind is K.SEND_GRAD, action.peer_stage)
        for action in group:
            for hook in hooks:
                hook.on_instruction_end(action.name, action)
