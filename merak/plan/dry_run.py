"""Run a candidate's real training step for a few steps: its measured step time and memory.

The step is the one `MerakTrainer` runs, built the same way (`merak.parallelize`, FSDP2 for
ZeRO-2/3, `ZeroRedundancyOptimizer` for ZeRO-1, the `PipelineInterpreter` with the candidate's
schedule and recomputation), on random token windows. Every rank of the job takes part (a
collective); each returns the slowest rank's step time and the fullest rank's memory.

Memory: on CUDA the allocator's peak; on CPU, where the allocator keeps no statistics, the
bytes of the rank's model states (weights, gradients, optimizer state, counted from the live
tensors after the steps) plus the activation meter's peak (what the step kept for backward).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist

import merak
from merak.data_parallel.shards import local
from merak.plan.costs import fastest
from merak.plan.predict import Candidate
from merak.trainer.model_setup import local_optimizer, zero1


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


@dataclass(frozen=True)
class Measured:
    """A dry run's figures, each the highest over the ranks."""

    step_s: float
    peak_bytes: float
    state_bytes: float       # weights, gradients, optimizer state
    activation_bytes: float  # the peak of what the step kept for backward (CUDA: the rest)


def dry_run(candidate: Candidate, config, seq: int, steps: int = 3,
            recompute_ratios: list[float] | None = None,
            dtype: torch.dtype | None = None, parallel_vocab: bool = False) -> Measured:
    """The figures of `candidate` training the HF causal LM `config` describes, timed after
    one warm-up step."""
    from transformers import AutoModelForCausalLM

    from merak.data_parallel.zero import shard_stage

    c = candidate
    if c.recompute == "budget" and recompute_ratios is None:
        raise ValueError(f"{c.label}: a budget recomputation needs its per-stage ratios "
                         f"(the prediction's recompute_ratios)")
    ctx = merak.init(dp=c.dp, tp=c.tp, pp=c.pp)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    rows = c.micro_batch
    ids = torch.randint(0, config.vocab_size, (rows, seq))
    stage = merak.parallelize(model, {"input_ids": ids, "labels": ids}, ctx,
                              num_model_chunks=c.chunks, parallel_vocab=parallel_vocab,
                              sequence_parallel=c.sequence_parallel)
    zero = shard_stage(stage, ctx, c.zero) if c.zero >= 2 else None
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)
    if c.zero == 1:
        optimizer = zero1(optimizer, ctx)
    ratios = recompute_ratios if recompute_ratios is not None else \
        (1.0 if c.recompute == "full" else 0.0)
    engine = merak.PipelineInterpreter(stage, ctx, optimizer, c.microbatches,
                                       schedule=c.schedule, recompute_ratio=ratios, zero=zero,
                                       autocast_dtype=dtype,
                                       measure_activations=ctx.device.type != "cuda")
    generator = torch.Generator().manual_seed(ctx.dp_rank)
    rows_per_step = rows * c.microbatches

    def batch():
        ids = torch.randint(0, config.vocab_size, (rows_per_step, seq), generator=generator)
        return {"input_ids": ids, "labels": ids} if engine.batch_keys else None

    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    step_s = fastest(ctx.device, lambda: engine.train_step(batch()), steps,  # + a warm-up
                     dist.barrier)
    allocated = float(torch.cuda.max_memory_allocated()) if ctx.device.type == "cuda" else 0.0
    for param in stage.parameters():  # count the gradients as a step holds them
        if param.grad is None and param.requires_grad:
            param.grad = torch.zeros_like(param)
    states = float(_state_bytes(stage, optimizer))
    activations = allocated - states if allocated else float(engine.activation_peak or 0)
    peak = states + activations
    figures = torch.tensor([step_s, peak, states, activations], dtype=torch.float64,
                           device=ctx.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    engine.remove_recomputation()
    del engine, optimizer, stage, model, zero
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return Measured(*figures.tolist())
