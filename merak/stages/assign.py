"""Assign a sequence of units (glue before the blocks, the blocks, glue after) to stages.

Every method returns ``stage_of_unit``: one stage id per unit, non-decreasing, each stage owning
at least one unit and every unit owned exactly once, whatever the counts (30 blocks on 4 stages
keep all 30). Units are contiguous, so the first glue always lands on stage 0 and the last on the
last stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

PARTITION_METHODS = ("uniform", "uniform_floor", "parameters", "custom", "profile")


def _check(num_units: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_units:
        raise ValueError(f"cannot split {num_units} pieces into {num_stages} stages: every stage "
                         f"needs at least one; use at most {num_units} stages or a finer split")


def _from_counts(counts: Sequence[int]) -> list[int]:
    return [stage for stage, n in enumerate(counts) for _ in range(n)]


def uniform(num_blocks: int, num_stages: int, *, floor: bool = False,
            num_before: int = 1, num_after: int = 1) -> list[int]:
    """Blocks as evenly as possible; the glue units before/after go to the first/last stage.

    With `floor`, each stage gets ``num_blocks // num_stages`` blocks and the remainder goes to
    the last stages (`uniform_floor`); otherwise the first stages take the remainder.
    """
    _check(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    counts = [base + (1 if (s >= num_stages - extra if floor else s < extra) else 0)
              for s in range(num_stages)]
    counts[0] += num_before
    counts[-1] += num_after
    return _from_counts(counts)


def custom(num_blocks: int, boundaries: Sequence[int], *, num_before: int = 1,
           num_after: int = 1) -> list[int]:
    """`custom_partition` as in Merak: block indices where stages start, ``[0, b1, ..., L]``."""
    bounds = list(boundaries)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_blocks or \
            any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"custom_partition must rise strictly from 0 to the number of blocks "
                         f"({num_blocks}), e.g. [0, {num_blocks // 2}, {num_blocks}]; got {bounds}")
    counts = [b - a for a, b in itertools.pairwise(bounds)]
    counts[0] += num_before
    counts[-1] += num_after
    return _from_counts(counts)


def balanced(weights: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split minimizing the heaviest stage (ties: lighter earlier stages).

    Used for `parameters` (weights = parameter counts) and `profile` (weights = measured
    forward+backward times), AutoPipe-style: the slowest stage bounds pipeline throughput.
    """
    n = len(weights)
    _check(n, num_stages)
    prefix = [0.0]
    for w in weights:
        if w < 0:
            raise ValueError(f"unit weights must be non-negative, got {w}")
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: minimal heaviest stage splitting the first i units into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return _from_counts(counts[::-1])


def stage_loads(weights: Sequence[float], stage_of_unit: Sequence[int]) -> list[float]:
    loads = [0.0] * (max(stage_of_unit) + 1)
    for w, s in zip(weights, stage_of_unit):
        loads[s] += w
    return loads
