"""`MerakArguments`' recomputation fields turned into per-stage ratios for the interpreter
(the ratios an engine starts with: `merak.trainer.engine_options.initial_recompute_ratio`).

* ``activation_checkpointing`` alone: every block of every stage.
* ``activation_checkpoint_ratio`` with one value per stage: those fractions.
* ``activation_checkpoint_ratio`` with one value: the first stage's fraction; the later stages
  recompute the least that keeps their peak at or below the first's (stage-aware).
* ``activation_memory_budget``: each stage the least that fits its budget.

The last two are planned from a measurement (`merak.recompute.stage_aware`) once a batch exists;
until then the interpreter recomputes every block.
"""

from __future__ import annotations

import torch

from merak.recompute.stage_aware import (
    choose_ratios,
    measure_kept,
    predict_peaks,
    stage_aware_ratios,
)
from merak.trainer.engine_options import plans_recomputation


def plan_recomputation(engine, args, batch: dict[str, torch.Tensor]) -> list[float] | None:
    """For the planned modes, measure (`batch`: one step of micro-batches), choose the ratios,
    apply them to `engine` and return them with a log line; None for the other modes."""
    pp = engine.ctx.pp
    if not plans_recomputation(args, pp):
        return None
    segment, m = args.checkpoint_num_layers, engine.num_microbatches
    schedule, edges = args.train_schedule, engine.split.edges or None
    kept = measure_kept(engine, batch, segment)
    if args.activation_memory_budget is not None:
        budget = [b * 2**20 for b in args.activation_memory_budget]
        if len(budget) == 1:
            budget *= pp
        if len(budget) != pp:
            raise ValueError(f"MerakArguments.activation_memory_budget has {len(budget)} values "
                             f"for {pp} pipeline stages; give one for all or one per stage")
        ratios = choose_ratios(schedule, pp, m, kept, budget, edges)
    else:
        ratios = stage_aware_ratios(schedule, pp, m, kept, args.activation_checkpoint_ratio[0],
                                    edges)
    engine.set_recomputation(ratios, segment)
    if engine.ctx.rank == 0:
        peaks = predict_peaks(schedule, pp, m, kept, ratios, edges)
        print("recomputation per stage: " + ", ".join(
            f"stage {s} {r:.2f} of {k.num_blocks} blocks" for s, (r, k) in
            enumerate(zip(ratios, kept))) + "; peak per rank " + ", ".join(
            f"{p / 2**20:.2f} MiB" for p in peaks), flush=True)
    return ratios
