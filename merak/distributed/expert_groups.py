"""Expert parallelism's rank layout: the ep ranks are carved from the dp x cp replicas of one
(pp, tp) coordinate and add no ranks.

A replica's index is ``dp_rank * cp + cp_rank`` (0 .. dp*cp-1). Consecutive runs of ep replicas
form an expert-parallel group (they split a layer's experts among them, ``ep_rank = index %
ep``); the replicas with the same ep_rank form an expert-data-parallel group (they hold the
same experts, dp*cp/ep of them), over which expert gradients are reduced.
"""

from __future__ import annotations

import torch.distributed as dist


def check_ep(ep: int, dp: int, cp: int) -> None:
    """`ep` must be a positive int dividing dp * cp; raised before any group is made."""
    if isinstance(ep, bool) or not isinstance(ep, int):
        raise TypeError(f"merak.init: ep must be a positive int, got {ep!r}")
    if ep <= 0:
        raise ValueError(f"merak.init: ep must be positive, got ep={ep}")
    if (dp * cp) % ep:
        shown = f"dp = {dp}" if cp == 1 else f"dp * cp = {dp} * {cp} = {dp * cp}"
        raise ValueError(
            f"merak.init: ep={ep} does not divide {shown}: expert parallelism splits the "
            f"data-parallel replicas of a stage and adds no ranks; choose an ep that divides "
            f"{dp * cp} (e.g. ep={_largest_divisor(dp * cp, ep)}) or raise dp")


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _global_rank(pp_rank: int, replica: int, tp_rank: int, dp: int, cp: int, tp: int) -> int:
    dp_rank, cp_rank = divmod(replica, cp)
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def expert_rank_lists(dp: int, tp: int, pp: int, cp: int, ep: int,
                      ) -> tuple[list[list[int]], list[list[int]]]:
    """Every expert-parallel group's global ranks and every expert-data-parallel group's, in
    one order on every rank."""
    replicas = dp * cp
    ep_lists, edp_lists = [], []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = lambda r, pp_rank=pp_rank, tp_rank=tp_rank: _global_rank(  # noqa: E731
                pp_rank, r, tp_rank, dp, cp, tp)
            ep_lists += [[rank(block * ep + e) for e in range(ep)]
                         for block in range(replicas // ep)]
            edp_lists += [[rank(block * ep + e) for block in range(replicas // ep)]
                          for e in range(ep)]
    return ep_lists, edp_lists


def make_expert_groups(dp: int, tp: int, pp: int, cp: int, ep: int, backend: str | None = None,
                       ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (ep group, edp group); every rank creates every group, in one order."""
    ep_lists, edp_lists = expert_rank_lists(dp, tp, pp, cp, ep)
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_lists, backend=backend)
    edp_group, _ = dist.new_subgroups_by_enumeration(edp_lists, backend=backend)
    return ep_group, edp_group
