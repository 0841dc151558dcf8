"""Run an interleaved schedule: one rank, v model chunks (virtual stages), one program.

Each chunk is driven by a `PipelineInterpreter` of its own virtual stage (same handlers: load,
forward, backward, recomputation, p2p), which sees the pipeline through a
`VirtualStageContext` (``pp`` = p * v, ``stage_id`` = its virtual stage; ranks and process groups
the real ones). `InterleavedInterpreter` walks the rank's program (`InterleavedSchedule`),
handing each action to its chunk, and runs the per-step tail once for the whole rank: tied
weights summed across ranks, one data-parallel all-reduce over every chunk's gradients, one
optimizer step. Messages carry the pair of chunks in their tag, since one rank pair carries
several virtual-stage pairs (stage 0 -> 1 and stage p -> p + 1 both go rank 0 -> rank 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merak.data_parallel.grad_sync import GradientAverager
from merak.distributed.parallel_context import ParallelContext
from merak.pipeline.actions import Action, ActionKind
from merak.pipeline.hooks import InstructionHook
from merak.pipeline.interleaved import (
    INTERLEAVED_SCHEDULES,
    InterleavedSchedule,
    validate_interleaved,
)
from merak.pipeline.interleaved_stage import InterleavedStage
from merak.pipeline.interpreter import PipelineInterpreter
from merak.pipeline.p2p import _MAX_SLOTS, _META_TAG, StageComm, _tag
from merak.pipeline.schedules import forward_block
from merak.pipeline.stage import PipelineStage
from merak.pipeline.stage_aware import stage_chunks
from merak.pipeline.step_tail import StepTail, TiedGroups, step_loss, tied_weight_groups

K = ActionKind


class VirtualStageContext:
    """`ctx` as one virtual stage sees it: pipeline coordinates count virtual stages
    (``pp`` = p * v, ``stage_id`` = `virtual_stage`, virtual stage k on rank ``k % p``); every
    other attribute (ranks, dp/tp coordinates, groups, device) is `ctx`'s."""

    def __init__(self, ctx: ParallelContext, virtual_stage: int, num_chunks: int):
        self.base, self.virtual_stage, self.num_chunks = ctx, virtual_stage, num_chunks

    def __getattr__(self, name: str):
        if name == "base":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def pp(self) -> int:
        return self.base.pp * self.num_chunks

    num_stages = pp

    @property
    def pp_rank(self) -> int:
        return self.virtual_stage

    stage_id = pp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.virtual_stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.virtual_stage == self.pp - 1

    def rank_of(self, *, pp_rank: int | None = None, dp_rank: int | None = None,
                tp_rank: int | None = None) -> int:
        """Global rank running virtual stage `pp_rank` at the given (dp, tp) coordinates."""
        pp_rank = self.virtual_stage if pp_rank is None else pp_rank
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"virtual stage {pp_rank} is outside 0..{self.pp - 1}")
        return self.base.rank_of(pp_rank=pp_rank % self.base.pp, dp_rank=dp_rank,
                                 tp_rank=tp_rank)

    def stage_rank(self, stage_id: int) -> int:
        return self.rank_of(pp_rank=stage_id)


def check_tag_space(num_microbatches: int, num_chunks: int) -> None:
    """Interleaved tags fold the chunk pair into the micro-batch id; keep them below the
    shape-handshake tags."""
    if (num_microbatches + 1) * num_chunks ** 2 * 2 * _MAX_SLOTS >= _META_TAG:
        raise ValueError(f"{num_microbatches} micro-batches x {num_chunks}^2 chunk pairs exceed "
                         f"the p2p tag space; use fewer micro-batches or chunks")


class VirtualStageComm(StageComm):
    """`StageComm` of one virtual stage: tags name the (lower, upper) chunk pair of the edge,
    so virtual-stage pairs sharing a rank pair never match each other's messages."""

    def channel(self, peer_stage: int) -> int:
        low, high = sorted((self.stage_id, peer_stage))
        p, v = self.ctx.base.pp, self.ctx.num_chunks
        return (low // p) * v + high // p

    def tag(self, peer_stage: int, microbatch_id: int, is_grad: bool, slot: int) -> int:
        pairs = self.ctx.num_chunks ** 2
        return _tag(microbatch_id * pairs + self.channel(peer_stage), is_grad, slot)

    def meta_tag(self, peer_stage: int) -> int:
        return _META_TAG + 1 + self.channel(peer_stage)


class _ChunkInterpreter(PipelineInterpreter):
    """The interpreter of one chunk, driven one action at a time by `InterleavedInterpreter`
    (which also owns the per-step tail: no tied-weight groups here)."""

    _comm_class = VirtualStageComm

    def __init__(self, stage: PipelineStage, ctx: VirtualStageContext,
                 optimizer: torch.optim.Optimizer, num_microbatches: int, **options):
        super().__init__(stage, ctx, optimizer, num_microbatches, lend_idle_cores=False,
                         **options)

    def _build_tied_groups(self) -> list:
        return []

    def begin(self, actions: list[Action], batch: dict[str, torch.Tensor] | None,
              num_microbatches: int, loss_scale: float) -> None:
        """Start a step (or an evaluation) running `actions`, this chunk's part of it."""
        self.loss_scale = loss_scale
        self._begin(actions, batch, num_microbatches)
        self._next = 0

    def execute(self, action: Action) -> None:
        """Run the next action of this chunk (the rank program keeps each chunk's order)."""
        index = self._next
        assert self._run_actions[index] == action, (self._run_actions[index], action)
        self._execute(index, action, hooks=())
        self._next += 1

    def end(self) -> list[torch.Tensor]:
        """Finish the step: wait for this chunk's sends; returns its losses (last stage)."""
        assert self._next == len(self._run_actions), "the step ended before the chunk's actions"
        self.comm.finish_step()
        losses, self._state, self._losses = self._losses, [], []
        return losses



class InterleavedInterpreter(StepTail):
    """Executes one rank's program of an interleaved schedule, one step per `train_step()`.

    Args:
        stage: this rank's chunks: an `InterleavedStage`
            (``merak.parallelize(..., num_model_chunks=v)``) or the `PipelineStage`s of virtual
            stages ``c * pp + pp_rank`` in chunk order, of one split
            into ``ctx.pp * num_chunks`` virtual stages.
        ctx: the parallel context (real ranks: ``ctx.pp`` pipeline ranks, at least 2).
        optimizer: built over every chunk's parameters (``stage.parameters()``).
        num_microbatches: micro-batches per step, a multiple of ``ctx.pp``.
        schedule: a name in `INTERLEAVED_SCHEDULES` or an explicit `InterleavedSchedule`.
        hooks: `InstructionHook`s called around every action of the program;
            ``self.virtual_stage`` names the virtual stage of the current action (None for the
            per-step tail).
        recompute_ratio: per virtual stage (or one value): the fraction of its blocks whose
            activations are recomputed; the schedule gets `recompute` actions for those.
        p2p_timeout_s, bucket_bytes, autocast_dtype, grad_predivide, checkpoint_num_layers,
        tp_rng: as for `PipelineInterpreter`.
    """

    def __init__(self, stage: InterleavedStage | Sequence[PipelineStage], ctx: ParallelContext,
                 optimizer: torch.optim.Optimizer, num_microbatches: int,
                 schedule: str | InterleavedSchedule = "interleaved_1f1b",
                 hooks: Sequence[InstructionHook] = (), p2p_timeout_s: float = 300.0,
                 bucket_bytes: int = 25 * 2**20, autocast_dtype: torch.dtype | None = None,
                 grad_predivide: float = 1.0, recompute_ratio: float | Sequence[float] = 0.0,
                 checkpoint_num_layers: int = 1, tp_rng: object = None):
        self.stage = stage if isinstance(stage, InterleavedStage) else InterleavedStage(stage)
        chunks, split = self.stage.chunks, self.stage.split
        p, v = ctx.pp, len(chunks)
        if p < 2:
            raise ValueError(f"an interleaved schedule needs pp >= 2 pipeline ranks, got pp={p}")
        expected = [c * p + ctx.pp_rank for c in range(v)]
        if split.num_stages != p * v or self.stage.stage_ids != expected:
            raise ValueError(f"rank {ctx.rank} (pp rank {ctx.pp_rank}) must hold virtual stages "
                             f"{expected} of a split into pp * chunks = {p * v} stages; got "
                             f"stages {self.stage.stage_ids} of {split.num_stages}")
        check_tag_space(num_microbatches, v)
        checkpointed = stage_chunks(split, recompute_ratio, checkpoint_num_layers)
        if isinstance(schedule, str):
            if schedule not in INTERLEAVED_SCHEDULES:
                raise ValueError(f"unknown interleaved schedule {schedule!r}; choose one of "
                                 f"{sorted(INTERLEAVED_SCHEDULES)}")
            schedule = INTERLEAVED_SCHEDULES[schedule](
                p, num_microbatches, v, recompute=[bool(c) for c in checkpointed])
        if (schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches) != \
                (p, v, num_microbatches):
            raise ValueError(f"the schedule is for {schedule.num_ranks} ranks x "
                             f"{schedule.num_chunks} chunks x {schedule.num_microbatches} "
                             f"micro-batches, not {p} x {v} x {num_microbatches}")
        validate_interleaved(schedule, split.edges or None)
        virtual = schedule.virtual
        self.chunks = [_ChunkInterpreter(
            chunk, VirtualStageContext(ctx, chunk.stage_id, v), optimizer, num_microbatches,
            schedule=virtual, p2p_timeout_s=p2p_timeout_s, bucket_bytes=bucket_bytes,
            autocast_dtype=autocast_dtype, grad_predivide=grad_predivide,
            recompute_ratio=recompute_ratio, checkpoint_num_layers=checkpoint_num_layers,
            tp_rng=tp_rng) for chunk in chunks]
        self._chunk_of = {c.stage.stage_id: c for c in self.chunks}
        self.ctx, self.optimizer, self.split, self.schedule = ctx, optimizer, split, schedule
        self.num_microbatches = num_microbatches
        self.program = list(schedule.programs[ctx.pp_rank])
        self.hooks = list(hooks)
        self.batch_keys = list(dict.fromkeys(k for c in self.chunks for k in c.batch_keys))
        self.loss_scale = 1.0  # set by an fp16 loss scaler
        self.skip_optimizer_step = False  # set before the step by a hook (fp16 overflow)
        self.kept: torch.Tensor | None = None
        self.virtual_stage: int | None = None
        self.global_step = 0
        params = list({id(q): q for q in self.stage.parameters()}.values())
        self.grad_averager = GradientAverager(params, ctx.dp_group, bucket_bytes, grad_predivide)
        self._tp_partial = [q for q in params if getattr(q, "tp_partial_grad", False)]
        self._tied = self._build_tied_groups()
        self._step_handlers = {K.REDUCE_TIED_GRADS: self._reduce_tied_grads,
                               K.REDUCE_GRADS: self._reduce_grads,
                               K.OPTIMIZER_STEP: self._optimizer_step}

    @property
    def recompute(self) -> list:
        """Each chunk's `BlockRecomputation` (``remove()`` them to unwrap the blocks)."""
        return [c.recompute for c in self.chunks]

    def _build_tied_groups(self) -> TiedGroups:
        """Weights tied across ranks, grouped by the ranks sharing them. Copies on two chunks of
        one rank are one parameter (`InterleavedStage`): autograd sums them."""
        ctx, p = self.ctx, self.ctx.pp
        by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for tied in self.split.tied_weights:
            params = by_ranks.setdefault(tuple(sorted({s % p for s in tied.stages})), [])
            mine = {id(q): q for q in (self._chunk_of[s].stage.get_parameter(n)
                                       for s, n in tied.names if s % p == ctx.pp_rank)}
            if len(mine) > 1:
                raise ValueError(f"the tied weight {tied.names} is {len(mine)} parameters on "
                                 f"rank {ctx.rank}; materialize the rank's chunks together "
                                 f"(materialize_(InterleavedStage(...)))")
            params += [q for q in mine.values() if all(q is not r for r in params)]
        return tied_weight_groups(ctx, {ranks: params for ranks, params in by_ranks.items()
                                        if len(ranks) > 1})

    # -- the step -----------------------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor] | None) -> float:
        """Run one optimizer step over `batch` (this dp rank's share of the global batch);
        returns the step's loss (mean over micro-batches and dp ranks) on every rank."""
        loss = self._run(self.program, batch, self.num_microbatches, self.hooks)
        self.global_step += 1
        return loss

    def eval_step(self, batch: dict[str, torch.Tensor] | None,
                  num_microbatches: int | None = None, keep: str | None = None) -> float:
        """Forward only, without gradients, in eval mode (see `PipelineInterpreter.eval_step`).
        Micro-batches run in order, each through the rank's chunks in order."""
        m = num_microbatches or self.num_microbatches
        check_tag_space(m, len(self.chunks))
        num_stages = self.split.num_stages
        program = [(c.stage.stage_id, a) for mb in range(m) for c in self.chunks
                   for a in forward_block(c.stage.stage_id, num_stages, mb)]
        last = self._chunk_of.get(num_stages - 1)
        if last is not None:
            last._keep, last._kept = keep, []
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                loss = self._run(program, batch, m, hooks=())
            self.kept = torch.cat(last._kept) if last is not None and last._kept else None
            return loss
        finally:
            self.stage.train(was_training)
            if last is not None:
                last._keep, last._kept = None, []

    def _run(self, program: list[tuple[int | None, Action]],
             batch: dict[str, torch.Tensor] | None, num_microbatches: int,
             hooks: Sequence[InstructionHook]) -> float:
        if self.batch_keys and batch is None:
            raise ValueError(f"rank {self.ctx.rank} reads {self.batch_keys} from the batch but "
                             f"got batch=None")
        for chunk in self.chunks:
            chunk.begin([a for s, a in program if s == chunk.stage.stage_id], batch,
                        num_microbatches, self.loss_scale)
        for hook in hooks:
            hook.on_step_begin(self.global_step)
        for stage_id, action in program:
            self.virtual_stage = stage_id
            for hook in hooks:
                hook.on_instruction_begin(action.name, action)
            if stage_id is None:
                self._step_handlers[action.kind]()
            else:
                self._chunk_of[stage_id].execute(action)
            for hook in hooks:
                hook.on_instruction_end(action.name, action)
        self.virtual_stage = None
        losses = [loss for chunk in self.chunks for loss in chunk.end()]
        loss = step_loss(self.ctx, losses)
        for hook in hooks:
            hook.on_step_end(self.global_step)
        return loss
