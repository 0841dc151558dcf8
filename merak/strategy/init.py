"""`merak.init`: the parallel context of the job, its degrees given or read from a plan file.

The context itself (`merak.distributed.parallel_context.init`) knows nothing of plans; this
is the one place where a ``merak plan`` file (plan.json) turns into degrees.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from merak.distributed import parallel_context
from merak.distributed.parallel_context import ParallelContext
from merak.strategy.search import read_strategy_plan


def degrees_from_plan(path: str | Path) -> tuple[int, int, int, int, int]:
    """(dp, tp, pp, cp, ep) of the layout a ``merak plan`` file chose."""
    chosen = read_strategy_plan(path)[0]
    return chosen.dp, chosen.tp, chosen.pp, chosen.cp, chosen.ep


def init(dp: int | None = None, tp: int | None = None, pp: int | None = None,
         backend: str | None = None, *, timeout: datetime.timedelta | float | None = None,
         plan: str | Path | None = None, cp: int | None = None, ep: int | None = None,
         ) -> ParallelContext:
    """Initialize torch.distributed (if needed) and build the (pp, dp, cp, tp) device mesh; see
    `merak.distributed.parallel_context.init` for every argument but `plan` (`cp`: the
    context-parallel degree, default 1, see docs/context-parallel.md; `ep`: the
    expert-parallel degree, default 1, see docs/expert-parallel.md).

    Args:
        plan: a ``merak plan`` file (plan.json): its chosen degrees (the degree arguments must
            be left out or agree).

    Raises:
        ValueError: the degrees disagree with the plan's, or see the context's `init`.
    """
    if plan is not None:
        planned = degrees_from_plan(plan)
        given = (dp, tp, pp, cp, ep)
        if any(g is not None and g != p for g, p in zip(given, planned)):
            raise ValueError(f"merak.init: (dp, tp, pp, cp, ep) = {given} disagree with the "
                             f"plan {plan}'s {planned}; leave the degrees out to use the plan's")
        dp, tp, pp, cp, ep = planned
    return parallel_context.init(dp, tp, pp, backend, timeout=timeout, cp=cp,
                                  ep=1 if ep is None else ep)
