"""Schedule generators: each rank's order of compute blocks, before communication is placed.

A generator is a pure function ``(num_ranks, num_microbatches, stages_per_rank, recompute) ->
one list of actions per rank``, built from two blocks (a micro-batch's forward on one stage, its
backward on one stage), so schedules differ only in the order they place the blocks. Sends and
receives appear here without a peer: `merak.schedule.registry.lower` expands them over the
split's edges and groups them for NCCL. `recompute` holds one flag per stage: the backward blocks
of a flagged stage hold a `recompute` action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from merak.schedule.actions import Action, ActionKind
from merak.schedule.arrival import receive_on_arrival

K = ActionKind
Order = list[list[Action]]


def forward_block(stage_id: int, microbatch_id: int) -> list[Action]:
    """Receive, load, run and send one micro-batch's forward on `stage_id`."""
    return [Action(kind, stage_id, microbatch_id)
            for kind in (K.RECV_ACT, K.LOAD, K.FORWARD, K.SEND_ACT)]


def backward_block(stage_id: int, microbatch_id: int, recompute: bool = False,
                   early: bool = False, split: bool = False) -> list[Action]:
    """Receive output grads, run and send input grads of one micro-batch's backward.

    With `recompute`, the recomputed blocks are rerun first: right before the backward, or
    with `early` before the output gradient is waited for (so the rerun overlaps its transfer).
    With `split`, the backward computes input gradients only (`backward_input`)."""
    kinds = [K.RECOMPUTE] if recompute and early else []
    kinds.append(K.RECV_GRAD)
    kinds += [K.RECOMPUTE] if recompute and not early else []
    kinds += [K.BACKWARD_INPUT if split else K.BACKWARD, K.SEND_GRAD]
    return [Action(kind, stage_id, microbatch_id) for kind in kinds]


def check_sizes(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def gpipe(num_ranks: int, num_microbatches: int, stages_per_rank: int,
          recompute: Sequence[bool]) -> Order:
    """``ds_default`` (GPipe): all forwards, then all backwards. Holds every micro-batch."""
    return [[a for mb in range(num_microbatches) for a in forward_block(s, mb)]
            + [a for mb in range(num_microbatches) for a in backward_block(s, mb, recompute[s])]
            for s in range(num_ranks)]


def one_f_one_b_order(stage_id: int, num_stages: int, num_microbatches: int,
                      backward: Callable[[int], list[Action]]) -> list[Action]:
    """One stage's 1F1B order, with `backward(mb)` giving each micro-batch's backward block:
    ``num_stages - stage_id - 1`` warm-up forwards, then one forward and one backward at a time,
    then the remaining backwards."""
    num_warmup = min(num_stages - stage_id - 1, num_microbatches)
    actions = [a for mb in range(num_warmup) for a in forward_block(stage_id, mb)]
    for i in range(num_microbatches - num_warmup):
        actions += forward_block(stage_id, num_warmup + i) + backward(i)
    for mb in range(num_microbatches - num_warmup, num_microbatches):
        actions += backward(mb)
    return actions


def one_f_one_b(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                recompute: Sequence[bool], early_recompute: bool = False) -> Order:
    """``1f1b``: stage s holds at most ``min(num_stages - s, num_microbatches)`` micro-batches
    in flight. `early_recompute` places each recomputation before the wait for its output
    gradient."""
    return [one_f_one_b_order(s, num_ranks, num_microbatches,
                              lambda mb, s=s: backward_block(s, mb, recompute[s], early_recompute))
            for s in range(num_ranks)]


def pre_recompute_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                       recompute: Sequence[bool]) -> Order:
    """1F1B with every recomputation issued before the wait for its output gradient."""
    return one_f_one_b(num_ranks, num_microbatches, 1, recompute, early_recompute=True)


def last_no_recompute_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                           recompute: Sequence[bool]) -> Order:
    """1F1B with recomputation on every stage but the last."""
    return one_f_one_b(num_ranks, num_microbatches, 1, [*recompute[:-1], False])


def shifted_critical_path(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                          recompute: Sequence[bool]) -> Order:
    """Both of the above: early recomputation and none on the last stage (see
    `merak.schedule.registry` for the reorderings tried and why they are not part of it)."""
    return one_f_one_b(num_ranks, num_microbatches, 1, [*recompute[:-1], False],
                       early_recompute=True)


def zero_bubble(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                recompute: Sequence[bool]) -> Order:
    """ZB-H1: 1F1B's order with each backward split; stage s defers its first s weight
    gradients, so the input gradients race upstream and the deferred weight gradients fill the
    drain. With equal forward, input-gradient and weight-gradient times each stage idles
    ``(p - 1)`` of them, a third of 1F1B's ``3 (p - 1)``. At most ``num_stages`` micro-batches
    await their weight gradient on any stage: 1F1B's peak (stage 0's)."""
    order = []
    for s in range(num_ranks):
        deferred: list[int] = []

        def backward(mb: int, s=s, deferred=deferred) -> list[Action]:
            block = backward_block(s, mb, recompute[s], split=True)
            deferred.append(mb)
            if len(deferred) > s:
                block.append(Action(K.BACKWARD_WEIGHT, s, deferred.pop(0)))
            return block

        actions = one_f_one_b_order(s, num_ranks, num_microbatches, backward)
        order.append(actions + [Action(K.BACKWARD_WEIGHT, s, mb) for mb in deferred])
    return order


def interleaved_groups(num_microbatches: int, group_size: int) -> list[range]:
    """The micro-batches in groups of `group_size` (Megatron-LM's
    ``microbatch_group_size_per_vp_stage``), the last group taking the remainder (g to 2g - 1
    micro-batches). Megatron leaves the remainder a short group of its own; with fewer than p
    micro-batches in it, a rank's forward of the group's next chunk waits for a forward the
    last rank only runs after a backward that waits for it (p=8, v=3, m=17: rank 7's backward of
    micro-batch 8 on chunk 1 needs rank 0's on chunk 2, which follows rank 0's forward of
    micro-batch 16 on chunk 2, which needs rank 7's on chunk 1, which follows that backward)."""
    count = max(num_microbatches // group_size, 1)
    bounds = [i * group_size for i in range(count)] + [num_microbatches]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def interleaved_units(rank: int, num_ranks: int, num_microbatches: int, stages_per_rank: int,
                      group_size: int) -> tuple[list[tuple[bool, int, int]], int]:
    """Rank `rank`'s order of interleaved 1F1B, ``(is_forward, model chunk, microbatch_id)`` per
    compute block, and its number of warm-up forwards, ``2 (p - r - 1) + (v - 1) G`` with G the
    largest group (Megatron's count when the groups are equal). Forwards take each group through
    chunk 0, then the same group through chunk 1, ...; backwards walk the same order with the
    chunks walked down."""
    p, v = num_ranks, stages_per_rank
    groups = interleaved_groups(num_microbatches, group_size)
    table = [(chunk, mb) for group in groups for chunk in range(v) for mb in group]
    total = len(table)

    def unit(k: int, forward: bool) -> tuple[bool, int, int]:
        chunk, mb = table[k]
        return forward, chunk if forward else v - 1 - chunk, mb

    num_warmup = min(2 * (p - rank - 1) + (v - 1) * max(len(g) for g in groups), total)
    order = [unit(k, True) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order += [unit(num_warmup + k, True), unit(k, False)]
    return order + [unit(k, False) for k in range(total - num_warmup, total)], num_warmup


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int,
                     recompute: Sequence[bool], group_size: int | None = None) -> Order:
    """Interleaved 1F1B (Megatron-LM; Narayanan et al., SC 2021): v model chunks per rank, the
    bubble v-fold smaller than 1F1B's at the price of v times the messages. Any number of
    micro-batches m >= p, in groups of `group_size` (default p; p <= g <= m) through the
    chunks (`interleaved_groups`). With m a multiple of p and g = p (Megatron's original
    schedule) each receive is posted right before its computation; otherwise a rank computes
    between a message's arrival and its use, and receives are posted where they arrive
    (`merak.schedule.arrival`)."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if v < 2:
        raise ValueError(f"interleaved_1f1b needs >= 2 model chunks per rank (num_model_chunks, "
                         f"--interleave), got {v}; with one chunk per rank use 1f1b")
    if p < 2:
        raise ValueError("interleaved_1f1b needs >= 2 pipeline ranks (a rank cannot send to "
                         "itself); with one rank use 1f1b")
    if m < p:
        raise ValueError(f"interleaved_1f1b needs at least as many micro-batches ({m}) as "
                         f"pipeline ranks ({p}), as in Megatron-LM")
    g = p if group_size is None else group_size
    if not p <= g <= m:
        raise ValueError(f"interleaved_1f1b's micro-batch group size must lie in [pipeline "
                         f"ranks, micro-batches] = [{p}, {m}], got {g}")
    order = []
    for rank in range(p):
        units, num_warmup = interleaved_units(rank, p, m, v, g)
        blocks: list[list[Action]] = []
        for forward, chunk, mb in units:
            s = chunk * p + rank
            blocks.append(forward_block(s, mb) if forward else backward_block(s, mb, recompute[s]))
        pairs_end = num_warmup + 2 * (m * v - num_warmup)
        actions = [a for block in blocks[:num_warmup] for a in block]
        for k in range(num_warmup, pairs_end, 2):  # the steady state: forward, backward
            actions += fused_pair(blocks[k], blocks[k + 1])
        actions += [a for block in blocks[pairs_end:] for a in block]
        order.append(actions)
    return order if m % p == 0 and g == p else receive_on_arrival(order, p * v)


def fused_pair(forward: list[Action], backward: list[Action]) -> list[Action]:
    """A steady-state forward and backward run back to back, their receives before both and
    their sends after both (Megatron's interleaved pairing: the neighbours' matching sends and
    receives then fall into one posting group on every rank, which NCCL needs)."""
    comm_in = [a for a in forward + backward if a.kind in (K.RECV_ACT, K.RECV_GRAD)]
    comm_out = [a for a in forward + backward if a.kind in (K.SEND_ACT, K.SEND_GRAD)]
    work = [a for a in forward + backward if a not in comm_in and a not in comm_out]
    return comm_in + work + comm_out


def forward_only(placement: Sequence[int], num_microbatches: int) -> Order:
    """Evaluation: each micro-batch through the rank's stages in model order (`placement`: the
    rank of each stage)."""
    ranks = range(max(placement) + 1)
    return [[a for mb in range(num_microbatches)
             for s, r in enumerate(placement) if r == rank for a in forward_block(s, mb)]
            for rank in ranks]
