"""What the interpreter does once per step after a rank's last backward, whatever stages the rank
hosts: sum weights tied across pipeline ranks, average gradients over data parallelism, step
the optimizer, report the loss."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from merak.data_parallel.grad_sync import GradientAverager, finish_all_reduce, launch_all_reduce
from merak.data_parallel.zero import ZeroSharding
from merak.distributed import liveness
from merak.distributed.parallel_context import ParallelContext
from merak.schedule.actions import Action, ActionKind
from merak.stages.split import PipelineSplit

TiedGroups = list[tuple[dist.ProcessGroup, list[torch.nn.Parameter]]]


def tied_weight_groups(ctx: ParallelContext,
                       params_by_pp_ranks: Mapping[tuple[int, ...], list[torch.nn.Parameter]],
                       ) -> TiedGroups:
    """One process group per set of pipeline ranks sharing weights, per (dp, cp, tp) coordinate,
    with this rank's parameters of that set. Every rank creates every group in the same order
    (torch.distributed requires it), so every rank passes the same keys in the same order."""
    groups = []
    for pp_ranks, params in params_by_pp_ranks.items():
        for dp_rank in range(ctx.dp):
            for cp_rank in range(ctx.cp):
                for tp_rank in range(ctx.tp):
                    ranks = [ctx.rank_of(pp_rank=r, dp_rank=dp_rank, tp_rank=tp_rank,
                                         cp_rank=cp_rank) for r in pp_ranks]
                    group = dist.new_group(ranks)
                    if ctx.rank in ranks:
                        groups.append((group, params))
    return groups


def tied_parameter_groups(ctx: ParallelContext, split: PipelineSplit,
                          stages: Mapping[int, torch.nn.Module],
                          placement: Sequence[int]) -> TiedGroups:
    """Weights of `split` tied across pipeline ranks, with this rank's parameters of each, by
    the ranks sharing them (`tied_weight_groups`); `stages`: this rank's stages by id;
    `placement`: every stage's rank. Copies on two stages of one rank are one parameter
    (`InterleavedStage`): autograd sums them (a V puts the first and the last stage, GPT-2's
    tied embedding and head, both on rank 0)."""
    by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for tied in split.tied_weights:
        params = by_ranks.setdefault(tuple(sorted({placement[s] for s in tied.stages})), [])
        mine = {id(q): q for q in (stages[s].get_parameter(n)
                                   for s, n in tied.names if s in stages)}
        if len(mine) > 1:
            raise ValueError(f"the tied weight {tied.names} is {len(mine)} parameters on "
                             f"rank {ctx.rank}; materialize the rank's chunks together "
                             f"(materialize_(InterleavedStage(...)))")
        # a frozen weight (a LoRA model's base) has no gradient to sum
        params += [q for q in mine.values()
                   if q.requires_grad and all(q is not r for r in params)]
    return tied_weight_groups(ctx, {ranks: params for ranks, params in by_ranks.items()
                                    if len(ranks) > 1})


def last_weight_backwards(program: Sequence[Action]) -> dict[int, Action]:
    """Per stage of a rank's `program`, its last action that writes weight gradients (a
    backward, or a zero-bubble schedule's weight half): its gradients are final after it."""
    last = {}
    for action in program:
        if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            last[action.stage_id] = action
    return last


def step_loss(ctx: ParallelContext, losses: Sequence[torch.Tensor],
              weight: float | None = None) -> float:
    """The step's loss on every rank: the mean of the last stage's micro-batch losses (with a
    `weight`, their sum times it), averaged over the dp ranks (counted once per TP group). The
    sum travels on the rank's device."""
    local = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    if losses and ctx.tp_rank == 0:
        stacked = torch.stack([loss.reshape(()) for loss in losses]).double()
        local += (stacked.mean() if weight is None else stacked.sum() * weight).to(ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(local)
    return local.item() / ctx.dp


class StepTail:
    """The per-step actions (`reduce_tied_grads`, `reduce_grads`, `optimizer_step`) of an
    interpreter holding ``ctx``, ``optimizer``, ``grad_averager`` (`GradientAverager`),
    ``_tied`` (`tied_weight_groups`), ``_tp_partial`` (replicated parameters that saw only this
    TP rank's share), ``_experts`` (expert-parallel parameters), ``skip_optimizer_step`` (set
    by an fp16 loss scaler) and ``zero`` (ZeRO-2/3 sharding, or None)."""

    ctx: ParallelContext
    optimizer: torch.optim.Optimizer
    grad_averager: GradientAverager
    _tied: TiedGroups
    _tp_partial: list[torch.nn.Parameter]
    _experts: list[torch.nn.Parameter]
    skip_optimizer_step: bool
    zero: ZeroSharding | None

    @contextlib.contextmanager
    def _gradients_final(self, action: Action) -> Iterator[None]:
        """Around the step's last action writing `action.stage_id`'s weight gradients: dp
        buckets start their all-reduce, ZeRO units their reduce-scatter, as gradients become
        final (ZeRO-2/3 run no split backward: zero-bubble schedules are refused there)."""
        zero = self.zero.last_backward(action.stage_id) \
            if self.zero is not None and action.kind is ActionKind.BACKWARD \
            else contextlib.nullcontext()
        with self.grad_averager.last_backward(action.stage_id), zero:
            yield

    def _reduce_tied_grads(self, _: None = None) -> None:
        if self.zero is not None:  # the tail's first action: every shard's gradient, once
            with liveness.waiting("ZeRO's gradient reduce-scatter", group=self.ctx.dp_group):
                self.zero.reduce_scatter()
        for group, params in self._tied:
            if params:  # (every rank of the group holds the same frozen weights)
                with liveness.waiting("the tied-weight gradient all-reduce", group=group):
                    finish_all_reduce(params, *launch_all_reduce(params, group))

    def _reduce_grads(self, _: None = None) -> None:
        if self._tp_partial and self.ctx.tp > 1:
            with liveness.waiting("the tp gradient all-reduce", group=self.ctx.tp_group):
                finish_all_reduce(self._tp_partial,
                                  *launch_all_reduce(self._tp_partial, self.ctx.tp_group))
        with liveness.waiting("the dp gradient all-reduce", group=self.ctx.dp_group):
            self.grad_averager.average()
        if self._experts:  # each rank's expert gradients hold its ep group's losses' share:
            # summed over the replicas holding the same experts, divided by every replica
            with liveness.waiting("the expert gradient all-reduce", group=self.ctx.edp_group):
                finish_all_reduce(self._experts, *launch_all_reduce(
                    self._experts, self.ctx.edp_group), divisor=self.ctx.replicas)

    def _optimizer_step(self, _: None = None) -> None:
        if self.skip_optimizer_step:
            self.skip_optimizer_step = False
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
