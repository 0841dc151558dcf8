"""The one pipeline interpreter: runs a stage's action list on its stage module."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from merak.data_parallel.grad_sync import GradientAverager
from merak.distributed.parallel_context import ParallelContext
from merak.pipeline.actions import COMPUTE_KINDS, RECV_KINDS, Action, ActionKind, Schedule
from merak.pipeline.cpu_threads import IdleCoreLending
from merak.pipeline.hooks import InstructionHook
from merak.pipeline.memory import ActivationMeter
from merak.pipeline.p2p import Pending, StageComm
from merak.pipeline.recompute import BlockRecomputation
from merak.pipeline.schedules import forward_block, make_schedule
from merak.pipeline.split import ValueKey
from merak.pipeline.split_backward import backward_input, backward_weight
from merak.pipeline.stage import PipelineStage, block_names
from merak.pipeline.stage_aware import stage_chunks
from merak.pipeline.step_tail import StepTail, TiedGroups, step_loss, tied_weight_groups
from merak.pipeline.validate import validate_schedule

K = ActionKind


def split_microbatches(batch: dict[str, torch.Tensor], num_microbatches: int,
                       keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """Cut each of `keys` of `batch` along dim 0 into `num_microbatches` equal parts."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"the batch lacks {missing}, which this stage reads; it has "
                         f"{sorted(batch)}")
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(num_microbatches)]
    for key in keys:
        tensor = batch[key]
        if tensor.shape[0] % num_microbatches:
            raise ValueError(f"batch[{key!r}] has {tensor.shape[0]} rows, which do not split "
                             f"into {num_microbatches} equal micro-batches; make the per-rank "
                             f"batch size a multiple of the number of micro-batches")
        for mb, chunk in enumerate(tensor.chunk(num_microbatches)):
            parts[mb][key] = chunk
    return parts


@dataclass
class _MicroBatchState:
    inputs: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    outputs: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[ValueKey, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    weight_grads: object = None  # what `backward_weight` needs, between the two halves


class PipelineInterpreter(StepTail):
    """Executes one stage's schedule, one training step per `train_step()` call.

    Args:
        stage: this rank's stage module (`PipelineStage`).
        ctx: the parallel context; ``ctx.stage_id`` must equal ``stage.stage_id``.
        optimizer: built over ``stage.parameters()``.
        num_microbatches: micro-batches per step (gradient accumulation steps).
        schedule: a name in `merak.pipeline.schedules.SCHEDULES` or explicit action lists.
        hooks: `InstructionHook`s called around every action.
        p2p_timeout_s: longest wait on one point-to-point transfer before failing.
        bucket_bytes: dp all-reduce bucket size.
        lend_idle_cores: on CPU with every rank on one host, give compute actions that the
            schedule runs alone the cores of the stages idling meanwhile (`IdleCoreLending`).
        autocast_dtype: run forwards under `torch.autocast` to this dtype (bf16 mixed
            precision; parameters, gradients and optimizer state stay fp32).
        grad_predivide: dp gradients are divided by this before the all-reduce, the rest after.
        recompute_ratio: fraction of each stage's blocks whose activations are recomputed (one
            value per stage, or one for all); the schedule gets `recompute` actions for the
            stages that recompute any.
        checkpoint_num_layers: consecutive blocks per checkpointed chunk (only the chunk's
            input is kept).
        measure_activations: count the activation bytes this stage keeps for backward;
            ``activation_peak`` then holds the last step's peak (`ActivationMeter`).
        tp_rng: the model's `TPRandomState`, replayed by recomputation with the default RNG.
    """

    _comm_class = StageComm  # a subclass may widen its tags (interleaved chunks)

    def __init__(self, stage: PipelineStage, ctx: ParallelContext,
                 optimizer: torch.optim.Optimizer, num_microbatches: int,
                 schedule: str | Schedule = "1f1b", hooks: Sequence[InstructionHook] = (),
                 p2p_timeout_s: float = 300.0, bucket_bytes: int = 25 * 2**20,
                 lend_idle_cores: bool = True, autocast_dtype: torch.dtype | None = None,
                 grad_predivide: float = 1.0, recompute_ratio: float | Sequence[float] = 0.0,
                 checkpoint_num_layers: int = 1, measure_activations: bool = False,
                 tp_rng: object = None):
        split = stage.split
        if split.num_stages != ctx.pp:
            raise ValueError(f"the split has {split.num_stages} stages but pp={ctx.pp}")
        if stage.stage_id != ctx.stage_id:
            raise ValueError(f"stage {stage.stage_id} given to rank {ctx.rank}, which runs "
                             f"stage {ctx.stage_id}")
        self.stage, self.ctx, self.optimizer = stage, ctx, optimizer
        self.autocast_dtype = autocast_dtype
        self.loss_scale = 1.0  # set by an fp16 loss scaler
        self._keep, self._kept, self.kept = None, [], None  # eval outputs kept (predict)
        self.skip_optimizer_step = False  # set before the step by a hook (fp16 overflow)
        self.split = split
        self.num_microbatches = num_microbatches
        self.hooks = list(hooks)
        single_host = os.environ.get("LOCAL_WORLD_SIZE", "1") == str(ctx.world_size)
        self._lend = lend_idle_cores and ctx.device.type == "cpu" and single_host and ctx.pp > 1
        self._schedule_spec, self.tp_rng = schedule, tp_rng
        self._blocks = [stage.get_submodule(n) for n in block_names(split, ctx.stage_id)]
        self.meter = ActivationMeter(list(stage.parameters()) + list(stage.buffers())) \
            if measure_activations else None
        self.activation_peak: int | None = None
        self.recompute = BlockRecomputation([], [], ctx.device)
        self.set_recomputation(recompute_ratio, checkpoint_num_layers)
        self.comm = self._comm_class(ctx, split, ctx.stage_id, p2p_timeout_s)
        self.batch_keys = split.batch_inputs(ctx.stage_id)
        self.grad_averager = GradientAverager(stage.parameters(), ctx.dp_group, bucket_bytes,
                                              grad_predivide)
        # replicated parameters that saw only this TP rank's heads or sequence shard
        self._tp_partial = [p for p in stage.parameters() if getattr(p, "tp_partial_grad", False)]
        self._tied = self._build_tied_groups()
        self._weights = [p for p in stage.parameters() if p.requires_grad]
        self.global_step = 0
        self._handlers: dict[ActionKind, Callable[[int | None], None]] = {
            K.LOAD: self._load, K.FORWARD: self._forward, K.BACKWARD: self._backward,
            K.RECOMPUTE: self._recompute, K.BACKWARD_INPUT: self._backward_input,
            K.BACKWARD_WEIGHT: self._backward_weight,
            K.SEND_ACT: self._send_act, K.RECV_ACT: self._recv_act,
            K.SEND_GRAD: self._send_grad, K.RECV_GRAD: self._recv_grad,
            K.REDUCE_TIED_GRADS: self._reduce_tied_grads, K.REDUCE_GRADS: self._reduce_grads,
            K.OPTIMIZER_STEP: self._optimizer_step,
        }

    def set_recomputation(self, ratio: float | Sequence[float], checkpoint_num_layers: int = 1,
                          schedule: str | Schedule | None = None) -> None:
        """(Re)build the schedule (`schedule`, or the current one) and the block recomputation
        for per-stage `ratio` (see the class doc); every rank calls it alike, between steps."""
        split, ctx = self.split, self.ctx
        chunks = stage_chunks(split, ratio, checkpoint_num_layers)
        self._schedule_spec = schedule = schedule or self._schedule_spec
        if isinstance(schedule, str):
            schedule = make_schedule(schedule, split.num_stages, self.num_microbatches,
                                     recompute=[bool(c) for c in chunks])
        validate_schedule(schedule, self.num_microbatches, edges=split.edges or None)
        for s, actions in enumerate(schedule):  # every rank checks every stage: same error
            if not any(a.kind is K.RECOMPUTE for a in actions):
                chunks[s] = []  # the schedule keeps this stage's activations (last_no_recompute)
            elif not chunks[s]:
                raise ValueError(f"the schedule recomputes on stage {s}, which checkpoints no "
                                 f"blocks; raise its recompute_ratio or drop its recompute "
                                 f"actions")
        self.recompute.remove()
        self.recompute = BlockRecomputation(self._blocks, chunks[ctx.stage_id], ctx.device,
                                            self.tp_rng, self.meter)
        self.chunks, self.schedule = chunks, schedule
        self.actions: list[Action] = schedule[ctx.stage_id]
        self.hooks = [h for h in self.hooks if not isinstance(h, IdleCoreLending)]
        if self._lend:
            self.hooks.insert(0, IdleCoreLending(schedule, ctx.stage_id, ctx.dp * ctx.tp,
                                                 split.edges))

    def measure_forward(self, batch: dict[str, torch.Tensor] | None,
                        chunks: Sequence[Sequence[int]]) -> int:
        """Activation bytes micro-batch 0's forward keeps on this stage for backward when it
        checkpoints the blocks in `chunks`; a collective (every rank calls it: the micro-batch
        moves through the pipeline). Draws random numbers as a forward does."""
        meter = self.meter
        self.recompute.remove()
        self.meter = ActivationMeter(list(self.stage.parameters()) + list(self.stage.buffers()))
        self.recompute = BlockRecomputation(self._blocks, chunks, self.ctx.device, self.tp_rng,
                                            self.meter)
        try:
            self._run(forward_block(self.ctx.stage_id, self.ctx.pp, 0), batch,
                      self.num_microbatches, hooks=())
            return self.meter.peak
        finally:
            self.recompute.remove()
            self.meter = meter
            self.recompute = BlockRecomputation(self._blocks, self.chunks[self.ctx.stage_id],
                                                self.ctx.device, self.tp_rng, meter)

    def _build_tied_groups(self) -> TiedGroups:
        """This stage's weights tied to other stages, grouped by the stages sharing them."""
        params = dict(self.stage.named_parameters())
        by_stages: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for tied in self.split.tied_weights:
            by_stages.setdefault(tied.stages, []).extend(
                params[n] for s, n in tied.names if s == self.ctx.stage_id)
        return tied_weight_groups(self.ctx, by_stages)

    # -- the step -----------------------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor] | None) -> float:
        """Run one optimizer step over `batch` (this dp rank's share of the global batch).

        Stages that read no batch input may pass None. Returns the step's loss (mean over
        micro-batches and dp ranks), on every rank.
        """
        loss = self._run(self.actions, batch, self.num_microbatches, self.hooks)
        if self.meter is not None:
            self.activation_peak = self.meter.peak
        self.global_step += 1
        return loss

    def eval_step(self, batch: dict[str, torch.Tensor] | None,
                  num_microbatches: int | None = None, keep: str | None = None) -> float:
        """Forward only, without gradients, in eval mode: the mean loss over `batch` (this dp
        rank's share) and the dp ranks, on every rank. Hooks are not called. With `keep`, the
        last stage also keeps that model output (e.g. ``"logits"``) of every micro-batch in
        ``self.kept``, concatenated along the batch dimension."""
        m = num_microbatches or self.num_microbatches
        self._keep, self._kept = keep, []
        actions = [a for mb in range(m)
                   for a in forward_block(self.ctx.stage_id, self.split.num_stages, mb)]
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                loss = self._run(actions, batch, m, hooks=())
            self.kept = torch.cat(self._kept) if self._kept else None
            return loss
        finally:
            self.stage.train(was_training)
            self._keep, self._kept = None, []

    def _run(self, actions: list[Action], batch: dict[str, torch.Tensor] | None,
             num_microbatches: int, hooks: Sequence[InstructionHook]) -> float:
        self._begin(actions, batch, num_microbatches)
        if self.meter is not None:
            self.meter.reset_peak()
        for hook in hooks:
            hook.on_step_begin(self.global_step)
        for index, action in enumerate(actions):
            self._execute(index, action, hooks)
        self.comm.finish_step()
        loss = step_loss(self.ctx, self._losses)
        for hook in hooks:
            hook.on_step_end(self.global_step)
        self._state = []
        return loss

    def _begin(self, actions: list[Action], batch: dict[str, torch.Tensor] | None,
               num_microbatches: int) -> None:
        """Set up the state of a step (or an evaluation) that runs `actions`."""
        if self.batch_keys and batch is None:
            raise ValueError(f"stage {self.ctx.stage_id} reads {self.batch_keys} from the "
                             f"batch but got batch=None")
        self._microbatches = split_microbatches(batch or {}, num_microbatches, self.batch_keys)
        self._state = [_MicroBatchState() for _ in range(num_microbatches)]
        self._pending: dict[Action, Pending] = {}
        self._losses: list[torch.Tensor] = []
        self._run_actions = actions
        self.comm.start_step()

    def _execute(self, index: int, action: Action, hooks: Sequence[InstructionHook]) -> None:
        """Run ``actions[index]`` of the step, its receives prefetched, between the hooks."""
        if action.kind in COMPUTE_KINDS:
            self._prefetch_receives(index)
        for hook in hooks:
            hook.on_instruction_begin(action.name, action)
        self._handlers[action.kind](action.microbatch_id)
        for hook in hooks:
            hook.on_instruction_end(action.name, action)

    def _prefetch_receives(self, index: int) -> None:
        """Post the receives between this compute action and the next, so their data arrives
        while this one computes. Receives whose shapes are not known yet wait until reached."""
        for action in self._run_actions[index + 1:]:
            if action.kind in COMPUTE_KINDS:
                return
            if action.kind in RECV_KINDS and action not in self._pending:
                if not self.comm.shapes_known(action.kind):
                    return
                self._pending[action] = self._post_receive(action)

    def _post_receive(self, action: Action) -> Pending:
        if action.kind is K.RECV_ACT:
            return self.comm.post_recv_activations(action.microbatch_id)
        return self.comm.post_recv_gradients(action.microbatch_id)

    # -- handlers -----------------------------------------------------------------------------
    def _load(self, mb: int) -> None:
        self._state[mb].inputs.update(
            {(name, -1): tensor for name, tensor in self._microbatches[mb].items()})

    def _recv_act(self, mb: int) -> None:
        action = Action(K.RECV_ACT, mb)
        pending = self._pending.pop(action, None) or self._post_receive(action)
        self._state[mb].inputs.update(self.comm.unpack_activations(pending.wait(self.comm)))

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype,
                              enabled=self.autocast_dtype is not None)

    def _forward(self, mb: int) -> None:
        state = self._state[mb]
        recording = self.meter.recording() if self.meter is not None else contextlib.nullcontext()
        self.recompute.begin_forward(mb)
        try:
            with self._autocast(), recording:
                values = self.stage(state.inputs)
        finally:
            self.recompute.end_forward()
        if self.ctx.is_last_stage:
            state.loss = values[self.split.output_key]
            if state.loss.numel() != 1:
                raise ValueError(f"the split's output {self.split.output!r} must be a scalar "
                                 f"loss, got shape {tuple(state.loss.shape)}")
            self._losses.append(state.loss.detach())
            if self._keep is not None:
                key = (self._keep, self.split.output_key[1])
                if key not in values:
                    raise KeyError(f"the model has no output {self._keep!r} to keep; it returns "
                                   f"{sorted(k[0] for k in values)}")
                self._kept.append(values[key].detach())
        keys = {k for keys in self.comm.send_plan.values() for k in keys}
        state.outputs = {k: values[k] for k in keys}

    def _send_act(self, mb: int) -> None:
        self.comm.send_activations(mb, self._state[mb].outputs)

    def _recv_grad(self, mb: int) -> None:
        action = Action(K.RECV_GRAD, mb)
        pending = self._pending.pop(action, None) or self._post_receive(action)
        self._state[mb].output_grads = self.comm.unpack_gradients(pending.wait(self.comm))

    def _roots(self, state: _MicroBatchState) -> tuple[list[torch.Tensor], list]:
        """What the backward starts from: the scaled loss, or the outputs and their grads."""
        if state.loss is not None:
            return [state.loss * (self.loss_scale / self.num_microbatches)], [None]
        keys = list(state.output_grads)
        return [state.outputs[k] for k in keys], [state.output_grads[k] for k in keys]

    def _grad_inputs(self, state: _MicroBatchState) -> dict[ValueKey, torch.Tensor]:
        return {key: value for key, value in state.inputs.items()
                if key[1] >= 0 and value.requires_grad}

    def _recompute(self, mb: int) -> None:
        self.recompute.recompute(mb, self._autocast())

    def _backward(self, mb: int) -> None:
        state = self._state[mb]
        roots, grads = self._roots(state)
        if roots:
            torch.autograd.backward(roots, grads)
        state.input_grads = {key: (value.grad if value.grad is not None
                                   else torch.zeros_like(value))
                             for key, value in self._grad_inputs(state).items()}
        self._free(mb)

    def _backward_input(self, mb: int) -> None:
        state = self._state[mb]
        roots, grads = self._roots(state)
        inputs = self._grad_inputs(state)
        dinputs, state.weight_grads = backward_input(roots, grads, list(inputs.values()),
                                                     self._weights)
        state.input_grads = dict(zip(inputs, dinputs))
        state.outputs, state.output_grads, state.loss = {}, {}, None

    def _backward_weight(self, mb: int) -> None:
        backward_weight(self._state[mb].weight_grads, self._weights)
        self._free(mb)

    def _free(self, mb: int) -> None:
        state = self._state[mb]
        state.inputs, state.outputs, state.output_grads, state.loss = {}, {}, {}, None
        state.weight_grads = None
        self.recompute.release(mb)

    def _send_grad(self, mb: int) -> None:
        self.comm.send_gradients(mb, self._state[mb].input_grads)
        self._state[mb].input_grads = {}
