"""Plan on the running job: measure, predict, dry-run the best few, keep the fastest measured.

Every rank calls `plan_online` (under torchrun); all get the same `StrategyPlan`. Every rank
measures the model's blocks at the same time, as they will train (sharing a host's cores, a node's
power), and the ranks' mean is used; the links are measured by all (`measure_links`). The best
`dry_runs` predicted candidates (distinct layouts and schedules first) then run a few real
steps each (`dry_run`); the fastest measured within the memory limit wins, and the table shows
predicted against measured figures.

Memory: a dry run's figure on CUDA includes what the device holds outside the caching allocator
(`dry_run.device_peak_bytes`), and each dry run destroys the process groups it made, as does
the plan itself at its end (`transient_process_groups`): no candidate's communicators stay on
the GPU while the next is judged.
"""

from __future__ import annotations

import os
import time
from dataclasses import fields, replace

import torch
import torch.distributed as dist

from merak.distributed.parallel_context import init
from merak.distributed.teardown import transient_process_groups
from merak.dryrun.run import dry_run
from merak.engine.options import EngineOptions
from merak.rules import Choices
from merak.strategy.candidate import Prediction
from merak.strategy.cluster import measure_links
from merak.strategy.costs import BlockCosts, measure_costs
from merak.strategy.predict import Predictor
from merak.strategy.reference import ReferenceCosts
from merak.strategy.search import StrategyPlan, search, sequence_parallel_choices
from merak.strategy.shape import ModelShape


def device_memory(ctx) -> float:
    """Memory one rank may use: the GPU's, or on CPU this node's RAM over its ranks."""
    if ctx.device.type == "cuda":
        return 0.9 * torch.cuda.get_device_properties(ctx.device).total_memory
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 0.8 * pages / int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))


def _averaged(costs: BlockCosts, ctx) -> BlockCosts:
    """Every rank measures at once, as the job will run (ranks sharing a host's cores or a
    node's power slow each other); the ranks' mean is the cost."""
    names = [f.name for f in fields(costs) if isinstance(getattr(costs, f.name), float)]
    values = torch.tensor([getattr(costs, n) for n in names], dtype=torch.float64,
                          device=ctx.device)
    dist.all_reduce(values)
    return replace(costs, **dict(zip(names, (values / ctx.world_size).tolist())))


def _distinct(ranked: list[Prediction], count: int, within: float = 1.5) -> list[Prediction]:
    """The `count` candidates to dry-run: first the best of each layout (dp x tp x pp x cp x ep,
    sequence parallelism) predicted within `within` times the best, then the best of each layout and
    micro-batch size, then of each layout and schedule, then the next best. The model errs
    most between layouts (ranks sharing cores or links, collectives), then between micro-batch
    sizes (per-micro-batch overheads it does not see), so the dry runs sample those first."""
    if not ranked:
        return []
    near = [p for p in ranked if p.step_s <= within * ranked[0].step_s]
    taken: list[Prediction] = []
    for key in (lambda c: (c.dp, c.tp, c.pp, c.cp, c.ep, c.sequence_parallel),
                lambda c: (c.dp, c.tp, c.pp, c.cp, c.ep, c.sequence_parallel, c.micro_batch),
                lambda c: (c.dp, c.tp, c.pp, c.cp, c.ep, c.sequence_parallel, c.schedule)):
        seen = {key(p.candidate) for p in taken}
        for p in near:
            if len(taken) == count:
                return taken
            if key(p.candidate) not in seen:
                taken.append(p)
                seen.add(key(p.candidate))
    rest = [p for p in ranked if p not in taken]
    return taken + rest[:count - len(taken)]


def plan_online(config, global_batch: int, seq: int, memory_bytes: float | None = None,
                micro_batch_sizes=(1, 2, 4, 8), dry_runs: int = 5, steps: int = 3,
                dtype: torch.dtype | None = None, parallel_vocab: bool = False,
                sequence_parallel: tuple[bool, ...] | None = None,
                options: EngineOptions | None = None, job: Choices | None = None,
                context_parallel: tuple[int, ...] = (1,),
                expert_parallel: tuple[int, ...] | None = (1,), imbalance: float = 1.0,
                reference: ReferenceCosts | None = None) -> StrategyPlan:
    """The plan for `config` on this job (every rank calls it; every rank gets the plan);
    `parallel_vocab` as the job will build its TP model; `sequence_parallel`: the settings
    to try where tp > 1 (default: `sequence_parallel_choices` of the config). `options`: the
    job's engine options, each dry run's with the candidate's choices (default: the defaults
    with `dtype` and `parallel_vocab`); `job`: the job's other choices, so only candidates
    `merak.rules` accepts for it are searched. `context_parallel`: the cp degrees to search
    (`merak.strategy.search.context_parallel_degrees`; 1 only by default: a job's rows must
    be unpadded for cp, which the planner cannot see); a cp candidate's dry run splits its
    rows as `MerakTrainer` does. `expert_parallel`: the ep degrees to search for an MoE model
    (None: every one that divides; `merak.strategy.search.candidates`), `imbalance`: its
    routing's (`merak.strategy.predict.Predictor`). `reference`: a preference trainer's
    reference forwards (`merak.strategy.reference.ReferenceCosts`), charged to every prediction
    as `merak plan --reference` charges them; a dry run runs the policy's step only, so its
    measured time and peak get the reference's predicted share (`_reference_share`)."""
    options = options or EngineOptions.for_dry_runs(dtype, parallel_vocab)
    start = time.perf_counter()
    with transient_process_groups():  # (the measuring layout's groups too)
        plan, best, memory = _plan_and_dry_run(config, global_batch, seq, memory_bytes,
                                               micro_batch_sizes, dry_runs, steps, options,
                                               sequence_parallel, job, context_parallel,
                                               expert_parallel, imbalance, reference)
    if best is None:
        label = min(plan.measured_memory, key=plan.measured_memory.get)
        raise ValueError(f"every dry run went over the memory limit of {memory / 2**30:.3g} "
                         f"GiB per rank; the least was {plan.measured_memory[label] / 2**30:.3g} "
                         f"GiB ({label}): raise the limit, or use more ranks or a smaller "
                         f"global batch")
    plan.chosen = best.candidate
    first = plan.ranked[0].candidate
    plan.why = (f"{best.candidate.label}: the fastest of {len(plan.measured)} dry runs, "
                f"{plan.measured[best.candidate.label]:.4g} s per step "
                f"(predicted {best.step_s:.4g} s)"
                + ("" if best.candidate == first else
                   f"; the predicted best, {first.label}, measured "
                   f"{plan.measured.get(first.label, float('nan')):.4g} s") + "\n" + plan.why)
    init()  # the default layout again
    plan.search_s = time.perf_counter() - start
    return plan


def _plan_and_dry_run(config, global_batch: int, seq: int, memory_bytes: float | None,
                      micro_batch_sizes, dry_runs: int, steps: int, options: EngineOptions,
                      sequence_parallel: tuple[bool, ...] | None, job: Choices | None,
                      context_parallel: tuple[int, ...] = (1,),
                      expert_parallel: tuple[int, ...] | None = (1,), imbalance: float = 1.0,
                      reference: ReferenceCosts | None = None
                      ) -> tuple[StrategyPlan, Prediction | None, float]:
    """`plan_online`'s measurements, search and dry runs: the plan, the fastest measured
    prediction within the memory limit (None when none is) and that limit."""
    ctx = init()  # every rank data-parallel while measuring
    memory = memory_bytes or device_memory(ctx)
    shape = ModelShape.from_config(config)
    sizes = [m for m in micro_batch_sizes if global_batch % m == 0]
    dtype = options.precision.autocast_dtype
    costs = {m: _averaged(measure_costs(config, m, seq, ctx.device, dtype,
                                        together=dist.barrier), ctx) for m in sizes}
    peak_flops = 1.0  # measured costs are times already; FLOP/s only enter offline plans
    cluster = measure_links(ctx, memory, peak_flops)
    if sequence_parallel is None:
        sequence_parallel = sequence_parallel_choices(config)
    plan = search(shape, costs, cluster, global_batch, seq, memory,
                  options.tensor_parallel.parallel_vocab, micro_batch_sizes=sizes,
                  sequence_parallel=sequence_parallel, job=job,
                  context_parallel=context_parallel, expert_parallel=expert_parallel,
                  imbalance=imbalance, reference=reference)
    # the same predictions without the reference: what a dry run (the policy's step) measures
    plain = None if reference is None or reference.mode == "none" else Predictor(
        shape, costs, cluster, memory, options.tensor_parallel.parallel_vocab, imbalance)
    best = None
    for prediction in _distinct(plan.ranked, dry_runs):
        c = prediction.candidate
        run = dry_run(c, config, seq, steps,
                      prediction.recompute_ratios if c.recompute == "budget" else None,
                      options=options)
        extra_s, extra_bytes = _reference_share(prediction, plain)
        plan.measured[c.label] = run.step_s + extra_s
        plan.measured_memory[c.label] = run.peak_bytes + extra_bytes
        if plan.measured_memory[c.label] <= memory and (
                best is None or plan.measured[c.label] < plan.measured[best.candidate.label]):
            best = prediction
    return plan, best, memory


def _reference_share(prediction: Prediction, plain: Predictor | None) -> tuple[float, float]:
    """The seconds and peak bytes the reference adds to `prediction` (its candidate predicted
    with the reference, less without: the pass before training over the epochs, or the
    reference forwards inside the step and a replica's weights); (0, 0) without a reference.
    A dry run measures the policy's step alone, so this is added to its figures."""
    if plain is None:
        return 0.0, 0.0
    alone = plain.predict(prediction.candidate)
    return prediction.step_s - alone.step_s, max(0.0, prediction.peak_bytes - alone.peak_bytes)
