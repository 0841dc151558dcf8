"""Run a candidate's real training step for a few steps: its measured step time and memory.

The step is the one `MerakTrainer` runs, built by the same assembly
(`merak.engine.build_engine`) from the job's `EngineOptions` with the candidate's choices
(`EngineOptions.with_candidate`), on random token windows. Every rank of the job takes part (a
collective); each returns the slowest rank's step time and the fullest rank's memory.

Memory: on CUDA the device memory the steps took (`device_peak_bytes`: the caching allocator's
peak reservation plus what the device holds outside it, NCCL communicators and the CUDA
context among them: a candidate whose tensors fit can still run out of memory there); on CPU,
where the allocator keeps no statistics, the bytes of the rank's model states (weights,
gradients, optimizer state, counted from the live tensors after the steps) plus the activation
meter's peak (what the step kept for backward).

Context parallelism (a candidate with cp > 1): the model's attention is wrapped for the
candidate's `cp_mode` before the engine is built, and each rank trains its load-balanced share
of every row (`merak.context_parallel.split_batch`), as `MerakTrainer` does.

A dry run leaves no process group behind: the mesh its `merak.init` builds and the tied-weight
groups are destroyed when it ends (`transient_process_groups`), and the default context is the
caller's again; otherwise each candidate's communicators would stay on the GPU, outside the
allocator, and the later candidates would be judged in less memory than training has.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from merak.context_parallel import enable_context_parallel, split_batch
from merak.context_parallel.split import IGNORE_INDEX, shift_labels
from merak.data_parallel.shards import local
from merak.data_parallel.zero1 import local_optimizer
from merak.distributed.parallel_context import init
from merak.distributed.teardown import transient_process_groups
from merak.engine.assemble import OptimizerFactory, build_engine, default_optimizer
from merak.engine.options import EngineOptions
from merak.materialize.meta import init_empty_weights
from merak.strategy.candidate import Candidate
from merak.strategy.costs import fastest


def _state_bytes(stage: torch.nn.Module, optimizer) -> int:
    """Bytes of the rank's weights, gradients and optimizer state, each storage once (a
    bucket's gradients share its buffer)."""
    seen, total = set(), 0
    tensors = [t for p in stage.parameters() for t in (p, p.grad)] + [
        v for state in local_optimizer(optimizer).state.values() for v in state.values()]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = local(tensor).untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def device_peak_bytes(device: torch.device) -> float:
    """The most CUDA memory this process took since the peak statistics were reset: the
    caching allocator's peak reservation (allocations, their fragmentation and the cache)
    plus the device's used memory outside the allocator now (``mem_get_info``'s used less the
    allocator's reservation: the CUDA context, NCCL's communicators and buffers, library
    workspaces, all made by the first steps and alive at the end). Another process's memory
    on the same GPU counts too: it is not this rank's to use either."""
    free, total = torch.cuda.mem_get_info(device)
    outside = max(total - free - torch.cuda.memory_reserved(device), 0)
    return float(torch.cuda.max_memory_reserved(device) + outside)


@dataclass(frozen=True)
class Measured:
    """A dry run's figures, each the highest over the ranks."""

    step_s: float
    peak_bytes: float        # CUDA: `device_peak_bytes`; CPU: states + activations
    state_bytes: float       # weights, gradients, optimizer state
    activation_bytes: float  # the peak of what the step kept for backward (CUDA: the rest)
    losses: tuple[float, ...] = ()  # every step's loss, the warm-up step first


def dry_run(candidate: Candidate, config, seq: int, steps: int = 3,
            recompute_ratios: list[float] | None = None,
            dtype: torch.dtype | None = None, parallel_vocab: bool = False,
            options: EngineOptions | None = None,
            make_optimizer: OptimizerFactory = default_optimizer,
            batches: Callable[[int], dict] | None = None) -> Measured:
    """The figures of `candidate` training the HF causal LM `config` describes (built with
    seed 0), timed after one warm-up step. `options`: the job's engine options, which the
    candidate's choices replace (default: the defaults with `dtype` and `parallel_vocab`);
    `make_optimizer`: the job's optimizer over a stage; `batches(step)`: this dp rank's rows
    of a step (default: random token windows). The process groups it made are destroyed and
    the caller's default context is restored before it returns."""
    base = options or EngineOptions.for_dry_runs(dtype, parallel_vocab)
    engine_options = base.with_candidate(candidate, recompute_ratios)
    with transient_process_groups():
        figures, losses = _run(candidate, config, seq, steps, engine_options, make_optimizer,
                               batches)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Measured(*figures, losses=tuple(losses))


def _run(c: Candidate, config, seq: int, steps: int, options: EngineOptions,
         make_optimizer: OptimizerFactory, batches: Callable[[int], dict] | None
         ) -> tuple[list[float], list[float]]:
    """`dry_run`'s figures and losses, with everything the steps made freed before it returns
    but the process groups (the caller destroys those)."""
    from transformers import AutoModelForCausalLM

    ctx = init(dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep)
    cuda = ctx.device.type == "cuda"
    torch.manual_seed(0)
    with init_empty_weights():
        # a copy: sharding the experts (ep > 1) sets the config's experts implementation,
        # which must not reach the caller's config (the trainer's model) or the next candidate
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    if ctx.cp > 1:  # attention across the cp ranks' shares of each row
        enable_context_parallel(model, ctx.cp_group, c.cp_mode)

    def share(batch: dict) -> dict | list[dict]:
        """This rank's part of a step's whole rows (all of them at cp = 1). With cp > 1, each
        micro-batch's load-balanced share, its loss divided by the micro-batch's whole target
        count (HF's ``num_items_in_batch``): the cp ranks' losses sum to the row's loss."""
        if ctx.cp == 1:
            return batch
        size = c.micro_batch
        parts = []
        for start in range(0, len(batch["input_ids"]), size):
            whole = {k: v[start:start + size] for k, v in batch.items()}
            shifted = shift_labels(whole["labels"])  # (split_batch takes it as it is)
            parts.append({**split_batch({**whole, "shift_labels": shifted}, ctx.cp, ctx.cp_rank),
                          "num_items_in_batch": (shifted != IGNORE_INDEX).sum()})
        return parts[0] if len(parts) == 1 else parts

    rows = c.micro_batch
    ids = torch.randint(0, config.vocab_size, (rows, seq))
    built = build_engine(model, share({"input_ids": ids, "labels": ids}), ctx,
                         replace(options, pipeline=replace(options.pipeline,
                                                           measure_activations=not cuda)),
                         make_optimizer=make_optimizer)
    stage, optimizer, engine = built.stage, built.optimizer, built.interpreter
    generator = torch.Generator().manual_seed(ctx.dp_rank)
    rows_per_step = rows * c.microbatches

    losses = []

    def step():
        if batches is not None:
            rows = batches(len(losses))
        else:
            ids = torch.randint(0, config.vocab_size, (rows_per_step, seq), generator=generator)
            rows = {"input_ids": ids, "labels": ids}
        losses.append(engine.train_step(share(rows) if engine.batch_keys else None))

    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    step_s = fastest(ctx.device, step, steps,  # + a warm-up
                     dist.barrier)
    allocated = float(torch.cuda.max_memory_allocated(ctx.device)) if cuda else 0.0
    device_peak = device_peak_bytes(ctx.device) if cuda else 0.0
    for param in stage.parameters():  # count the gradients as a step holds them
        if param.grad is None and param.requires_grad:
            param.grad = torch.zeros_like(param)
    states = float(_state_bytes(stage, optimizer))
    activations = allocated - states if allocated else float(engine.activation_peak or 0)
    peak = device_peak if cuda else states + activations
    figures = torch.tensor([step_s, peak, states, activations], dtype=torch.float64,
                           device=ctx.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    engine.remove_recomputation()
    built = engine = optimizer = stage = model = None  # (freed before the groups go)
    gc.collect()
    return figures.tolist(), losses
