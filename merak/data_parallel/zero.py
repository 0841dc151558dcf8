"""ZeRO-2 and ZeRO-3 for pipeline stages, through PyTorch's FSDP2 (`fully_shard` over the dp
dimension of the job's mesh).

What is sharded: each block of a stage (the split's repeated layers) is one FSDP unit, one
all-gather and one reduce-scatter; the stage itself is the root unit holding the rest
(embeddings, final norm, head). Under tensor parallelism a parameter is already this tp rank's
shard: FSDP shards that over the dp ranks. The shards stay fp32 (the master copy the optimizer
steps). Under bf16 the all-gather casts them to bf16 first (FSDP2's `MixedPrecisionPolicy`:
param_dtype bf16, reduce_dtype fp32): the forward's autocast would round every matmul weight to
bf16 anyway, so gathering fp32 moved twice the bytes for nothing; gradients accumulate over the
micro-batches and are reduce-scattered in fp32, so the sum over dp loses nothing. fp32 and fp16
(whose loss-scaled gradients the fp16 scaler checks) gather the fp32 shards as they are.

When gradients travel: once per step. Every micro-batch's backward runs with FSDP's gradient
sync off, so each unit's unsharded gradient accumulates locally (FSDP's ``no_sync``). The
interpreter knows which backward of a chunk is the step's last (FSDP cannot: a pipeline's
micro-batch backwards are separate autograd calls) and runs it inside `last_backward`, with
sync on: each unit reduce-scatters as soon as its own backward ends (FSDP's post-backward hook;
on a GPU the collective overlaps the backward of the units before it). The step tail then
calls FSDP's post-backward by hand for every unit, as `torch.distributed.pipelining` does in
its REDUCE_GRAD action: a no-op for the units already reduced, the reduce-scatter of any the
last backward did not reach.

When parameters are gathered:
- ZeRO-2: a unit is gathered at the step's first forward and kept whole until the step's
  reduce-scatter (``reshard_after_forward=False``, no reshard after each backward): one
  all-gather per unit per step; parameters whole from the first forward to the tail.
- ZeRO-3: a unit is gathered for each forward and each backward and freed right after
  (``reshard_after_forward=True``, reshard after every backward), so at most the unit being
  computed is whole. Keeping units whole across the step's micro-batches would save those
  re-gathers, but that is exactly ZeRO-2's memory: the stage choice is the memory choice.

Expert parallelism (ep > 1): the parameters `shard_experts` marked ``expert_parallel`` (an
experts module's ``[E/ep, ...]`` tensors) are held by the dp x cp / ep replicas of the
expert-data-parallel group only, so each experts module is its own unit, sharded over that
group (``ctx.edp_group`` as a 1-D mesh) before its block is, which then holds the rest of the
block over the replicas. An expert's gradient on a rank already holds its whole ep group's
rows: FSDP's reduce-scatter sums it over edp and divides by the edp size (dp x cp / ep), and
the unit's all-reduce hook divides by ep as well, so every expert gets the gradient of the mean
of the replicas' losses, as the other parameters do (and as `StepTail` does without ZeRO).

Outside a training step, an evaluation or a generation every unit is sharded: the step's
reduce-scatter, the end of an evaluation (`reshard`) and `gathered` each leave it so, so
checkpoints and exports always read the shards (DTensors).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from merak.distributed.parallel_context import ParallelContext
from merak.stages.stage import InterleavedStage, PipelineStage, block_names

# optimizers whose step is element-wise per parameter, so running it on each rank's shard is
# the same as running it on the whole tensor (FSDP2's own tests use these); others (Adafactor's
# row/column statistics, LAMB's per-tensor trust ratio, ...) see only the shard and differ
SHARDABLE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                        "Adadelta", "RMSprop", "ASGD", "Rprop")


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    name = type(optimizer).__name__
    if name not in SHARDABLE_OPTIMIZERS and not allow_untested:
        raise ValueError(
            f"zero_stage 2/3 steps each dp rank's shard of every parameter; {name} is not one "
            f"of the element-wise optimizers known to give the same result on shards "
            f"({', '.join(SHARDABLE_OPTIMIZERS)}). Use one of them, or set "
            f"zero_allow_untested_optimizer=True if {name} only works element by element")


class ZeroSharding:
    """FSDP2 over the dp group for the stages of one rank (see the module doc).

    Args:
        stage: this rank's stage, or its model chunks (`InterleavedStage`).
        ctx: the parallel context (its mesh's ``dp`` dimension is what is sharded over).
        zero_stage: 2 or 3.
        param_dtype: the dtype parameters are gathered in for compute (torch.bfloat16 when
            training in bf16); None gathers the fp32 shards as they are.
    """

    def __init__(self, stage: PipelineStage | InterleavedStage, ctx: ParallelContext,
                 zero_stage: int, param_dtype: torch.dtype | None = None):
        if zero_stage not in (2, 3):
            raise ValueError(f"ZeroSharding is ZeRO-2 or ZeRO-3, got zero_stage={zero_stage}")
        self.zero_stage, self.ctx = zero_stage, ctx
        policy = precision_policy(param_dtype)
        chunks = stage.stages if isinstance(stage, InterleavedStage) else [stage]
        attributes = _merak_attributes(stage)
        mesh = ctx.replica_mesh  # dp, or dp x cp (cp ranks hold the same weights)
        reshard = zero_stage == 3
        ep = getattr(ctx, "ep", 1)
        edp_mesh = expert_data_mesh(ctx) if ep > 1 else None
        self.roots: list[FSDPModule] = []
        for chunk in chunks:
            for unit in expert_units(chunk) if edp_mesh is not None else ():
                fully_shard(unit, mesh=edp_mesh, reshard_after_forward=reshard,
                            mp_policy=policy)
                unit.set_all_reduce_hook(functools.partial(_divide, by=ep))
            for name in block_names(chunk.split, chunk.stage_id):
                block = chunk.get_submodule(name)
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mesh=mesh, reshard_after_forward=reshard,
                                mp_policy=policy)
            fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
            self.roots.append(chunk)
        _restore_attributes(stage, attributes)
        self._accumulate()

    def modules(self) -> Iterator[FSDPModule]:
        for root in self.roots:
            yield from (m for m in root.modules() if isinstance(m, FSDPModule))

    def _accumulate(self) -> None:
        """Micro-batch backwards: keep unsharded gradients local; ZeRO-2 keeps parameters
        whole until the step's reduce-scatter."""
        for root in self.roots:
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(self.zero_stage == 3)
            root.set_is_last_backward(False)

    @contextlib.contextmanager
    def last_backward(self, stage_id: int) -> Iterator[None]:
        """Around the step's last backward of chunk `stage_id`: its units reduce-scatter (and
        reshard) as their backward ends."""
        root = next(r for r in self.roots if r.stage_id == stage_id)
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)
        root.set_is_last_backward(True)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(self.zero_stage == 3)
            root.set_is_last_backward(False)

    def reduce_scatter(self) -> None:
        """After the step's last backward: every unit's gradient reduce-scattered (averaged
        over dp) into its shard's ``.grad`` (those `last_backward` reduced already are left
        as they are) and the gathered parameters freed."""
        for root in self.roots:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            root.set_is_last_backward(True)
            # FSDP's post-backward by hand (private, as torch.distributed.pipelining's
            # `perform_reduce_grad` calls it): idempotent for a unit already reduced
            state = fully_shard.state(root)
            for unit in state._state_ctx.all_states:
                for group in unit._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        self._accumulate()

    def reshard(self) -> None:
        """Free whatever is gathered (after an evaluation)."""
        for module in self.modules():
            module.reshard()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit whole inside, and kept whole by the forwards run there (generation: the
        dp ranks decode different numbers of steps, so no forward may all-gather); resharded
        after."""
        for module in self.modules():
            module.unshard()
        for root in self.roots:
            root.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for root in self.roots:  # every unit was wrapped with this value
                root.set_reshard_after_forward(self.zero_stage == 3)
            self.reshard()


def expert_data_mesh(ctx: ParallelContext) -> DeviceMesh:
    """The expert-data-parallel group (the replicas holding this rank's experts) as the 1-D
    mesh FSDP2 shards the experts over (made from the existing group: no new process group)."""
    return DeviceMesh.from_group(ctx.edp_group, ctx.device.type, mesh_dim_names=("edp",))


def expert_units(module: nn.Module) -> list[nn.Module]:
    """The modules of `module` holding expert-parallel parameters (marked ``expert_parallel``
    by `merak.expert_parallel.shard_experts`): each is sharded over the edp group.

    Raises:
        ValueError: such a module also holds parameters of its own that are not per-expert
            (they would be sharded over the wrong group).
    """
    units = []
    for name, sub in module.named_modules():
        own = dict(sub.named_parameters(recurse=False))
        experts = [n for n, p in own.items() if getattr(p, "expert_parallel", False)]
        if experts and len(experts) < len(own):
            raise ValueError(
                f"zero_stage 2/3 with expert parallelism: {name} holds expert tensors "
                f"({', '.join(experts)}) and others ({', '.join(sorted(set(own) - set(experts)))})"
                f"; the experts are sharded over the expert-data-parallel group, the rest over "
                f"the replicas, so they must live in separate modules; use zero_stage=1")
        if experts:
            units.append(sub)
    return units


def _divide(gradient: torch.Tensor, by: int) -> None:
    """An experts unit's reduce-scatter output (FSDP2's all-reduce hook): the edp average
    divided by ep, i.e. the sum over edp divided by every replica."""
    gradient.div_(by)


def precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for ZeRO-2/3: gather in `param_dtype` and reduce-scatter in
    fp32 (gradients accumulate over the micro-batches in fp32 too); None keeps the parameters'
    own dtype throughout (FSDP2's default policy)."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_stage(stage: PipelineStage | InterleavedStage, ctx: ParallelContext,
                zero_stage: int, param_dtype: torch.dtype | None = None
                ) -> ZeroSharding | None:
    """ZeRO-2/3 for `stage` (`param_dtype`: see `ZeroSharding`), or None with a warning where
    there is nothing to shard over."""
    if ctx.replicas == 1:
        warnings.warn(f"zero_stage={zero_stage} with dp=1 shards nothing (ZeRO shards over the "
                      f"data-parallel ranks); training runs unsharded", stacklevel=2)
        return None
    return ZeroSharding(stage, ctx, zero_stage, param_dtype)


def _merak_attributes(stage: nn.Module) -> dict[str, dict]:
    """What Merak attached to each parameter (``tp_shard``, ``tp_partial_grad``, ...), by name:
    `fully_shard` replaces every parameter by a new DTensor one."""
    return {name: dict(p.__dict__) for name, p in stage.named_parameters(remove_duplicate=False)
            if p.__dict__}


def _restore_attributes(stage: nn.Module, attributes: dict[str, dict]) -> None:
    for name, param in stage.named_parameters(remove_duplicate=False):
        for key, value in attributes.get(name, {}).items():
            if not hasattr(param, key):
                setattr(param, key, value)

