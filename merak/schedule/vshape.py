"""V-shaped schedules: ZB-V and DualPipeV, two stages per rank placed in a V (`v_shape`).

With p ranks the model is cut into 2p stages; rank r holds stage r (its chunk 0, on the way
down) and stage 2p-1-r (its chunk 1, on the way back up), so rank 0 holds both the first stage
and the last one (the loss) and rank p-1 the two at the turn, which hand off locally. A
micro-batch's forward goes down the ranks and back up, its backward down and back up again.

Both orders come from one unit-time list schedule (`_Planner`): forward 1, input gradient 1,
weight gradient 1, recomputation 1, communication free; whenever a rank is free it runs the
unit its rule picks among the computations whose inputs have arrived (ZB-V: `_zbv_rule`), or
the next unit of its script once that unit's inputs have arrived (DualPipeV:
`dualpipev_script`). The receives are then placed where the plan says their messages arrive
(`merak.schedule.arrival`), which makes the programs deadlock-free under NCCL's rules.

ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): every backward split
into input and weight gradients; input gradients first (they are the critical path), then
forwards (chunk 1 first: it is nearer the loss), weight gradients whenever nothing else is
ready or memory is full. A rank holds at most 2p chunks in flight (a forward done, its weight
gradient not yet), p stages' worth: 1F1B's peak; a chunk-0 forward is taken only with room
left for its chunk-1 forward, so the plan never fills up halfway. With equal forward,
input-gradient and weight-gradient times the steady state has no bubble; what remains is the
fill no order on this placement avoids: rank p-1's first input arrives after p-1 chunk
forwards, and every rank does the same work, so each idles at least (p - 1) chunk forwards
(p = 4, m = 16: the plan reaches that bound).

DualPipeV (DeepSeek-V3's DualPipe, "cut in half" onto a V): in its steady state a rank pairs a
forward of one chunk with a backward of its other chunk (a forward of one micro-batch next to a
backward of another), the pair's receives posted before both and its sends after both;
backwards are whole (the weight gradients right after the pair's sends) except in the drain,
where weight gradients wait to fill the bubbles, as in ZB-V. Merak runs the two halves of a
pair one after the other on the rank's stream: their communication is paired, their
computations are not overlapped (DualPipe overlaps them on separate streams to hide MoE
all-to-alls; Merak has no expert parallelism to hide).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from merak.schedule.actions import Action, ActionKind
from merak.schedule.arrival import receive_on_arrival
from merak.schedule.generators import Order, backward_block, forward_block, fused_pair

K = ActionKind
F, I, W = "forward", "input", "weight"  # noqa: E741 - the three computations of ZB's papers
Op = tuple[str, int]  # (computation, chunk); a unit is one op or a forward-and-backward pair


class _Planner:
    """A unit-time list schedule of a V: per rank the next micro-batch of each chunk's forward
    and input gradient, the chunks awaiting their weight gradient, and the order so far."""

    def __init__(self, num_ranks: int, num_microbatches: int, recompute: Sequence[bool],
                 cap: int | None):
        self.p, self.m, self.recompute, self.cap = num_ranks, num_microbatches, recompute, cap
        self.forwards = [[0, 0] for _ in range(num_ranks)]
        self.inputs = [[0, 0] for _ in range(num_ranks)]
        self.weights: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
        self.in_flight = [0] * num_ranks
        self.done: dict[tuple[str, int, int], float] = {}  # (op, stage, mb) -> end time
        self.order: list[list[Action]] = [[] for _ in range(num_ranks)]

    def stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * self.p - 1 - rank

    def forward_ready(self, rank: int, chunk: int, t: float) -> bool:
        mb, s = self.forwards[rank][chunk], self.stage(rank, chunk)
        if mb >= self.m:
            return False
        if self.cap is not None:
            if self.in_flight[rank] >= self.cap or chunk == 0 and self.in_flight[rank] \
                    + self.forwards[rank][0] - self.forwards[rank][1] + 2 > self.cap:
                return False  # chunk 0: keep room for its micro-batches' chunk-1 forwards
        return s == 0 or self.done.get((F, s - 1, mb), t + 1) <= t

    def input_ready(self, rank: int, chunk: int, t: float) -> bool:
        mb, s = self.inputs[rank][chunk], self.stage(rank, chunk)
        if mb >= self.forwards[rank][chunk] or self.done[(F, s, mb)] > t:
            return False
        return s == 2 * self.p - 1 or self.done.get((I, s + 1, mb), t + 1) <= t

    def finished(self, rank: int) -> bool:
        return self.inputs[rank] == [self.m, self.m] and not self.weights[rank]

    def run(self, rank: int, unit: Sequence[Op], t: float) -> float:
        """Append `unit` to the rank's order starting at `t`; returns its end. A forward and
        an input gradient in one unit are a pair (receives before both, sends after both:
        their outputs leave at the pair's end); weight gradients follow the sends."""
        blocks, made, weights = [], [], []
        for op, chunk in unit:
            if op == W:  # the oldest weight gradient of `chunk` (else, or None: of any chunk)
                pending = self.weights[rank]
                index = next((i for i, (c, _) in enumerate(pending) if chunk in (None, c)), 0)
                chunk, mb = pending.pop(index)
                self.in_flight[rank] -= 1
                weights.append(Action(K.BACKWARD_WEIGHT, self.stage(rank, chunk), mb))
                continue
            s = self.stage(rank, chunk)
            if op == F:
                mb = self.forwards[rank][chunk]
                self.forwards[rank][chunk] += 1
                self.in_flight[rank] += 1
                t += 1
                blocks.append(forward_block(s, mb))
            else:
                mb = self.inputs[rank][chunk]
                self.inputs[rank][chunk] += 1
                self.weights[rank].append((chunk, mb))
                t += 2 if self.recompute[s] else 1
                blocks.append(backward_block(s, mb, self.recompute[s], split=True))
            made.append((op, s, mb))
        for key in made:
            self.done[key] = t
        self.order[rank] += fused_pair(*blocks) if len(blocks) == 2 else \
            [a for block in blocks for a in block]
        self.order[rank] += weights
        return t + len(weights)


Rule = Callable[[_Planner, int, float], list[Op] | None]


def _plan(num_ranks: int, num_microbatches: int, recompute: Sequence[bool], rule: Rule,
          cap: int | None) -> Order:
    """Each rank's order of blocks: whenever a rank is free (earliest first, ties by rank) it
    runs the unit `rule` picks, or waits for the next computation to end anywhere."""
    planner = _Planner(num_ranks, num_microbatches, recompute, cap)
    free = [0.0] * num_ranks
    ends = {0.0}
    waiting: set[tuple[int, float]] = set()
    while True:
        live = [r for r in range(num_ranks) if not planner.finished(r)]
        if not live:
            break
        now = min(free[r] for r in live)
        ready = [r for r in live if free[r] == now and (r, now) not in waiting]
        if not ready:
            later = [t for t in ends | {free[r] for r in live} if t > now]
            if not later:
                raise ValueError(f"the V schedule's plan is stuck at time {now}: ranks {live} "
                                 f"wait for each other")
            for r in live:
                free[r] = min(later) if free[r] == now else free[r]
            continue
        rank = ready[0]
        unit = rule(planner, rank, now)
        if unit is None:
            waiting.add((rank, now))
            continue
        free[rank] = planner.run(rank, unit, now)
        ends.add(free[rank])
    return receive_on_arrival(planner.order, 2 * num_ranks)


def _zbv_rule(plan: _Planner, rank: int, t: float) -> list[Op] | None:
    inputs = [c for c in (0, 1) if plan.input_ready(rank, c, t)]
    if inputs:  # the older micro-batch first; of equals, chunk 1 (its gradient goes on)
        return [(I, min(inputs, key=lambda c: (plan.inputs[rank][c], -c)))]
    for chunk in (1, 0):
        if plan.forward_ready(rank, chunk, t):
            return [(F, chunk)]
    return [(W, None)] if plan.weights[rank] else None


def dualpipev_script(num_ranks: int, num_microbatches: int, rank: int) -> list[list[Op]]:
    """Rank `rank`'s DualPipeV units in order (h = p - r - 1):

    1. 2h forwards of chunk 0 (the micro-batches the rank can take in before its first
       chunk-1 forward arrives);
    2. r + 1 times a forward of chunk 0, then one of chunk 1;
    3. h times a whole backward of chunk 1 (input, then weight gradients), then a forward of
       chunk 1;
    4. the steady state, m - 2p + r + 1 times: the pair (forward of chunk 0, backward of
       chunk 1), then the pair (forward of chunk 1, backward of chunk 0);
    5. h times a backward of chunk 1, then the pair (forward of chunk 1, backward of chunk 0);
    6. r + 1 times a backward of chunk 1, then one of chunk 0, their weight gradients deferred
       from the second half on (zero-bubble);
    7. h times a deferred weight gradient, then an input gradient of chunk 0;
    8. the deferred weight gradients.

    The counts follow from taking every micro-batch through both chunks; with fewer than 2p
    micro-batches the steps are cut where the micro-batches run out and what is left of the
    backwards runs in step 8's place."""
    p, m, r = num_ranks, num_microbatches, rank
    h = p - r - 1
    whole = lambda c: [(I, c), (W, c)]  # noqa: E731
    units: list[list[Op]] = [[(F, 0)]] * (2 * h) + [[(F, 0)], [(F, 1)]] * (r + 1)
    units += [whole(1), [(F, 1)]] * h
    units += [[(F, 0), *whole(1)], [(F, 1), *whole(0)]] * max(m - 2 * p + r + 1, 0)
    units += [whole(1), [(F, 1), *whole(0)]] * h
    for i in range(r + 1):  # (deferring all of step 6's: 1.5x the bubble at p = 4, 8)
        units += [[(I, 1)], [(I, 0)]] if i >= (r + 1) // 2 else [whole(1), whole(0)]
    units += [[(W, None)], [(I, 0)]] * h
    return _clip(units, m)


def _clip(units: list[list[Op]], m: int) -> list[list[Op]]:
    """`units` without the computations beyond the m micro-batches (a pair loses its missing
    half), then every input gradient still missing, and the weight gradients left."""
    count = {(op, c): 0 for op in (F, I) for c in (0, 1)}
    weights = 0
    kept: list[list[Op]] = []
    for unit in units:
        left = []
        for op, chunk in unit:
            if op == W:
                if weights > 0:
                    weights -= 1
                    left.append((op, chunk))
                continue
            if count[(op, chunk)] < m:
                count[(op, chunk)] += 1
                weights += op == I
                left.append((op, chunk))
        if left and left[0][0] == W and kept and any(o != W for o, _ in unit):
            kept[-1] += left  # a weight gradient whose input gradient was cut stays behind
        elif left:
            kept.append(left)
    for chunk in (1, 0):
        kept += [[(I, chunk)]] * (m - count[(I, chunk)])
        weights += m - count[(I, chunk)]
    return kept + [[(W, None)]] * weights


def _script_rule(scripts: list[list[list[Op]]]):
    position = [0] * len(scripts)

    def rule(plan: _Planner, rank: int, t: float) -> list[Op] | None:
        unit = scripts[rank][position[rank]]
        inputs = [op for op in unit if op[0] == I]
        forwards = [op for op in unit if op[0] == F]
        if all(plan.forward_ready(rank, c, t) for _, c in forwards) and \
                all(plan.input_ready(rank, c, t) for _, c in inputs):
            position[rank] += 1
            return unit
        return None
    return rule


def _check(name: str, stages_per_rank: int) -> None:
    if stages_per_rank != 2:
        raise ValueError(f"{name} places 2 stages on every rank (a V), not {stages_per_rank}")


def zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int,
        recompute: Sequence[bool]) -> Order:
    """ZB-V: zero-bubble order on the V (see the module docstring); at most 2p micro-batch
    chunks in flight per rank."""
    _check("zbv", stages_per_rank)
    return _plan(num_ranks, num_microbatches, recompute, _zbv_rule, 2 * num_ranks)


def dualpipev(num_ranks: int, num_microbatches: int, stages_per_rank: int,
              recompute: Sequence[bool]) -> Order:
    """DualPipeV's order on the V: forward-and-backward pairs of the two chunks, whole
    backwards, weight gradients deferred in the drain (see the module docstring)."""
    _check("dualpipev", stages_per_rank)
    scripts = [dualpipev_script(num_ranks, num_microbatches, r) for r in range(num_ranks)]
    return _plan(num_ranks, num_microbatches, recompute, _script_rule(scripts), None)
