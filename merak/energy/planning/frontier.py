"""Plan a GPU clock per pipeline instruction: the iteration-time / energy frontier (Perseus).

The DAG is built from the schedule's own per-rank programs (`merak.schedule.actions.Schedule`,
the very programs the interpreter runs), so the plan's instruction order always matches
execution. Every compute action of every rank's program (forward, backward, recompute,
backward_input, backward_weight) is a lowtime `Operation` keyed ``(pp_rank, action)``, whose
options are the profiled clocks of its rank and kind. Its dependencies are those of the
simulator's replay (`merak.schedule.simulator`): program order on a rank, and through the
rank's posting groups of sends and receives (a group starts once it is posted and the rank's
previous group finished; it finishes once every transfer's peer group started; the host waits
for a group that receives), so that with free communication a plan's longest path is exactly its
simulated iteration time. Lowtime's Phillips-Dessouky solver walks the frontier from the slowest
plan to the fastest, one time unit per iteration (optionally coarse to fine: a coarse walk, then
a fine one around the point that matters); every point is then re-timed exactly over the DAG and
scored on total energy:

    energy = sum of instruction energies + p2p_power * sum over GPUs of their idle time

(idle = blocked on p2p). Operation costs are ``energy - p2p_power * gpus * time`` so that the
solver minimizes that total (a GPU computing draws its instruction's energy instead of idling).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import networkx as nx
from lowtime.cost_model import CostModel, ExponentialModel
from lowtime.graph_utils import add_sink_node, add_source_node
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, Operation, OperationSpec

from merak.energy.planning.solver import fast_phillips_dessouky, phillips_dessouky
from merak.energy.profiling.profile_data import RankProfile
from merak.schedule.actions import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, Action, Schedule
from merak.schedule.simulator import simulate

Key = tuple[int, Action]  # (pipeline rank, compute action of its program)
ClockPlan = dict[Key, int]     # -> MHz


@dataclass
class FrontierPoint:
    time_s: float
    energy_j: float
    plan: ClockPlan = field(repr=False)


@dataclass
class PlanCosts:
    """Simulator costs of a plan: each compute action takes its clock's profiled time."""

    times: dict[Key, float]
    p2p: float = 0.0

    def duration(self, rank: int, action: Action) -> float:
        return self.times.get((rank, action), 0.0)


def compute_dependencies(schedule: Schedule) -> tuple[list[Key], list[tuple[Key, Key]]]:
    """Every rank's compute actions in program order, and the dependencies between them: the
    simulator's replay with free communication (see the module docstring), its posting groups
    contracted away and the result transitively reduced."""
    dag = nx.DiGraph()
    senders: dict[tuple, tuple] = {}    # message -> the group that sends it
    receivers: dict[tuple, tuple] = {}  # message -> the group that receives it
    compute: list[Key] = []
    for rank, program in enumerate(schedule.programs):
        host = last_group = None  # what the host clock waits on; the stream's last group
        for action in program:
            if action.group is not None:
                start, end = ("start", rank, action.group), ("end", rank, action.group)
                if start not in dag:
                    dag.add_edge(start, end)
                    for before in (host, last_group):
                        if before is not None:
                            dag.add_edge(before, start)
                    last_group = end
                if action.kind in RECV_KINDS:
                    receivers[action.message] = (rank, action.group)
                    host = end
                elif action.kind in SEND_KINDS:
                    senders[action.message] = (rank, action.group)
            elif action.kind in COMPUTE_KINDS:
                node = (rank, action)
                dag.add_node(node)
                if host is not None:
                    dag.add_edge(host, node)
                host = node
                compute.append(node)
    for message, (rank, group) in senders.items():
        peer, peer_group = receivers[message]
        dag.add_edge(("start", rank, group), ("end", peer, peer_group))
        dag.add_edge(("start", peer, peer_group), ("end", rank, group))
    is_compute = set(compute)
    frontier: dict = {}  # node -> the compute actions it waits on (through groups only)
    contracted = nx.DiGraph()
    contracted.add_nodes_from(compute)
    for node in nx.topological_sort(dag):
        waits = set().union(*(frontier[p] for p in dag.predecessors(node)))
        if node in is_compute:
            contracted.add_edges_from((p, node) for p in waits)
            frontier[node] = {node}
        else:
            frontier[node] = waits
    reduced = nx.transitive_reduction(contracted)
    index = {key: i for i, key in enumerate(compute)}  # an order independent of hashing
    return compute, sorted(reduced.edges, key=lambda e: (index[e[0]], index[e[1]]))


class ConvexHullModel(CostModel):
    """Piecewise-linear cost over the lower convex hull of the options' (quantized time, cost),
    extended linearly past its ends: the fallback where lowtime's `ExponentialModel` cannot fit
    a measured profile (noise can make a few clocks' energies non-convex, or leave fewer than
    three Pareto-optimal clocks). Convex and non-increasing over the options, as the
    Phillips-Dessouky solver needs."""

    def __init__(self, options: CandidateExecutionOptions):
        cheapest: dict[int, float] = {}
        for option in options.options:
            t = option.quant_time
            cheapest[t] = min(cheapest.get(t, option.cost), option.cost)
        hull: list[tuple[int, float]] = []
        for point in sorted(cheapest.items()):
            while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) <= 0:
                hull.pop()
            hull.append(point)
        while len(hull) >= 2 and hull[-1][1] >= hull[-2][1]:  # slower never costs more
            hull.pop()
        self.points = hull

    def __call__(self, quant_time: int) -> float:
        points = self.points
        if len(points) == 1:
            return points[0][1]
        i = 1
        while i < len(points) - 1 and points[i][0] < quant_time:
            i += 1
        (t0, c0), (t1, c1) = points[i - 1], points[i]
        return c0 + (c1 - c0) * (quant_time - t0) / (t1 - t0)


def _turn(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


class ClockFrontier:
    """Frontier and plan choice for `schedule` over the per-rank `profiles`.

    Args:
        schedule: the programs (`merak.schedule.registry.make_schedule`, or the interpreter's
            own ``engine.schedule``).
        profiles: one `RankProfile` per pipeline rank
            (`merak.energy.profiling.profile_data.aggregate`), with every instruction kind the
            rank's program runs.
        p2p_power: watts one GPU draws while blocked on communication.
        unit_time: the solver's time quantum in seconds (default: 1 ms, or 1/20 of the
            shortest instruction where that is finer).
    """

    def __init__(self, schedule: Schedule, profiles: list[RankProfile], p2p_power: float,
                 unit_time: float | None = None):
        if len(profiles) != schedule.num_ranks:
            raise ValueError(f"the profile has {len(profiles)} pipeline ranks, the schedule "
                             f"{schedule.num_ranks}; profile the same pipeline you plan for")
        self.schedule, self.profiles, self.p2p_power = schedule, profiles, p2p_power
        self.compute, self._edges = compute_dependencies(schedule)
        for rank in range(schedule.num_ranks):
            needed = sorted({a.name for a in schedule.compute_actions(rank)})
            missing = [k for k in needed if k not in profiles[rank].options]
            if missing:
                raise ValueError(f"pipeline rank {rank} runs {missing} instructions, which the "
                                 f"profile lacks (it has {sorted(profiles[rank].options)}); "
                                 f"profile with the schedule you plan for (train_schedule, "
                                 f"activation_checkpointing, num_model_chunks)")
        self.gpus = [len(p.ranks) for p in profiles]
        self.shortest_s = min(self.option(r, a, mhz)[0] for r, a in self.compute
                              for mhz in self.clocks(r, a))
        self.unit_time = unit_time or min(1e-3, self.shortest_s / 20)
        self._order: list[tuple[Key, list[int]]] | None = None
        self.fast = True  # `FastPhillipsDessouky` (False: lowtime's own loop, to check it)

    # -- exact scoring ------------------------------------------------------------------------
    def option(self, rank: int, action: Action, mhz: int) -> tuple[float, float]:
        return self.profiles[rank].options[action.kind.value][mhz]

    def clocks(self, rank: int, action: Action) -> dict[int, tuple[float, float]]:
        """Clock -> (time, energy) of `action` on pipeline rank `rank`, highest clock first."""
        return self.profiles[rank].options[action.kind.value]

    def evaluate(self, plan: ClockPlan) -> tuple[float, float]:
        """(iteration time, total energy) of `plan`: the longest path through the instruction
        DAG (what the simulator replays, without its per-action overhead: the planner scores
        thousands of points), idle time charged at the p2p power."""
        return self._evaluate(tuple(plan[key] for key in self.compute))

    def _evaluate(self, clocks: tuple[int, ...]) -> tuple[float, float]:
        """`evaluate` of the plan giving ``clocks[i]`` to ``self.compute[i]``."""
        if self._order is None:
            dag, key_of = self._dag()
            nodes = [n for n in nx.topological_sort(dag) if n in key_of]
            index = {n: i for i, n in enumerate(nodes)}
            position = {key: i for i, key in enumerate(self.compute)}
            self._order = [(position[key_of[n]], key_of[n][0], self.clocks(*key_of[n]),
                            [index[p] for p in dag.predecessors(n) if p in index])
                           for n in nodes]
        finish, busy, compute = [], [0.0] * self.schedule.num_ranks, 0.0
        for i, rank, options, preds in self._order:
            time_s, energy_j = options[clocks[i]]
            finish.append(max([finish[p] for p in preds], default=0.0) + time_s)
            busy[rank] += time_s
            compute += energy_j
        makespan = max(finish)
        idle = sum(g * (makespan - b) for g, b in zip(self.gpus, busy))
        return makespan, compute + self.p2p_power * idle

    def simulated(self, plan: ClockPlan) -> float:
        """`plan`'s iteration time replayed by the pipeline simulator (checks `evaluate`)."""
        times = {key: self.option(*key, mhz)[0] for key, mhz in plan.items()}
        return simulate(self.schedule, PlanCosts(times)).makespan

    def max_clock_plan(self) -> ClockPlan:
        return {(r, a): max(self.clocks(r, a)) for r, a in self.compute}

    def physical_limit(self) -> tuple[float, float]:
        """(time, energy) with every instruction at its own most energy-efficient clock,
        ignoring iteration time."""
        plan = {}
        for r, a in self.compute:
            options = self.clocks(r, a)
            plan[(r, a)] = min(options, key=lambda f, o=options: o[f][1])
        return self.evaluate(plan)

    # -- the frontier -------------------------------------------------------------------------
    def _candidates(self, rank: int, instruction: str, clocks, unit_time: float
                    ) -> CandidateExecutionOptions:
        options, gpus = self.profiles[rank].options[instruction], self.gpus[rank]
        return CandidateExecutionOptions(options=[
            ExecutionOption(real_time=options[mhz][0], unit_time=unit_time,
                            cost=options[mhz][1] - self.p2p_power * gpus * options[mhz][0],
                            knob=mhz)
            for mhz in clocks])

    def _spec(self, rank: int, instruction: str, clocks: tuple[int, ...],
              unit_time: float) -> OperationSpec:
        """The solver's operation: `clocks` to choose from, costs fitted over all clocks (a
        window of a few clocks is too few points to fit)."""
        every = self._candidates(rank, instruction, self.profiles[rank].options[instruction],
                                 unit_time)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # scipy's, for each grid point that fails
                model = ExponentialModel(every)
        except (ValueError, RuntimeError, TypeError):  # too few or too noisy to fit
            model = ConvexHullModel(every)
        return OperationSpec(options=self._candidates(rank, instruction, clocks, unit_time),
                             cost_model=model)

    def _dag(self) -> tuple[nx.DiGraph, dict[int, Key]]:
        """The instruction DAG (nodes 1.. are compute actions, 0 and the last are the source
        and sink) and node -> (rank, action); the solver's operations are added by the
        caller."""
        dag = nx.DiGraph()
        node_of = {key: node for node, key in enumerate(self.compute, start=1)}
        dag.add_nodes_from(node_of.values())
        dag.add_edges_from((node_of[a], node_of[b]) for a, b in self._edges)
        source, sink = 0, len(self.compute) + 1
        add_source_node(dag, source)
        add_sink_node(dag, sink)
        dag.graph["source_node"], dag.graph["sink_node"] = source, sink
        return dag, {node: key for key, node in node_of.items()}

    def _walk(self, unit_time: float, windows: dict[tuple[int, Action], tuple[int, ...]] | None
              = None) -> list[tuple[int, ...]]:
        """The plans lowtime's solver visits, slowest to fastest, with time quantum `unit_time`
        and each instruction's clocks restricted to `windows` (default: all its clocks); each
        as the clocks of ``self.compute`` in order."""
        dag, key_of = self._dag()
        specs: dict[tuple, OperationSpec] = {}
        for node, (rank, action) in key_of.items():
            clocks = windows[(rank, action)] if windows else tuple(self.clocks(rank, action))
            key = (rank, action.kind.value, clocks)
            if key not in specs:
                specs[key] = self._spec(rank, action.kind.value, clocks, unit_time)
            dag.nodes[node]["op"] = Operation(spec=specs[key])
        node_of = {key: node for node, key in key_of.items()}
        ops = [dag.nodes[node_of[key]]["op"] for key in self.compute]
        read = lambda: tuple(op.assigned_knob for op in ops)
        plans = [read()]
        logging.getLogger("lowtime").setLevel(logging.WARNING)
        solver = (fast_phillips_dessouky() if self.fast else phillips_dessouky())(dag)
        for _ in solver.run():
            plans.append(read())
        return plans

    def _points(self, plans: list[tuple[int, ...] | ClockPlan],
                scored: dict[tuple, FrontierPoint]) -> list[FrontierPoint]:
        """Every distinct plan of `scored` and `plans` (clock tuples as `_walk` gives them, or
        plans), scored once (`scored` keeps them)."""
        for plan in plans:
            clocks = plan if isinstance(plan, tuple) else tuple(plan[k] for k in self.compute)
            if clocks not in scored:
                scored[clocks] = FrontierPoint(*self._evaluate(clocks),
                                               dict(zip(self.compute, clocks)))
        return sorted(scored.values(), key=lambda p: (p.time_s, p.energy_j))

    def _plan(self, clocks: tuple[int, ...]) -> ClockPlan:
        return dict(zip(self.compute, clocks))

    def frontier(self, focus_time: float | None = None, coarse: int = 1,
                 window: int = 3) -> list[FrontierPoint]:
        """Points of the time / energy frontier (and the all-max-clock plan), each scored
        exactly, sorted by time.

        With ``coarse=1`` the solver walks the whole frontier at `unit_time`. With
        ``coarse=k > 1`` (coarse to fine) it walks it at ``k * unit_time`` (k times fewer
        iterations), takes the coarse plan `choose` would pick within `focus_time` (default:
        the all-max time) and walks again at `unit_time` with each instruction limited to the
        `window` clocks either side of its coarse clock: exact near the point that matters,
        coarse elsewhere.
        """
        max_plan = self.max_clock_plan()
        base_time = self.evaluate(max_plan)[0]
        coarse = self.coarse_factor(coarse)
        coarse_plans = self._walk(self.unit_time * coarse)
        scored: dict[tuple, FrontierPoint] = {}
        points = self._points(
            coarse_plans + [max_plan, self.fit(self._plan(coarse_plans[-1]), base_time)], scored)
        if coarse > 1:
            rough = self.choose(points, base_time,
                                target_time=focus_time if focus_time is not None else base_time)
            windows = {}
            for key in self.compute:
                clocks = list(self.clocks(*key))  # high to low
                at = clocks.index(rough.plan[key])
                windows[key] = tuple(clocks[max(0, at - window):at + window + 1])
            fine = self._walk(self.unit_time, windows)
            points = self._points(fine + [self.fit(self._plan(fine[-1]), base_time)], scored)
        return points

    def coarse_factor(self, wanted: int) -> int:
        """`wanted`, capped so that the shortest instruction still spans 10 coarse units (the
        solver fits each instruction's cost curve over its quantized times)."""
        return max(1, min(wanted, int(self.shortest_s / (10 * self.unit_time))))

    def fit(self, plan: ClockPlan, limit: float) -> ClockPlan:
        """`plan` with the instructions of its critical path raised to the highest clock until
        it takes at most `limit` seconds. The solver's fastest point can overshoot the all-max
        time by a few time units (each instruction's time is rounded down to whole units)."""
        plan = dict(plan)
        dag, key_of = self._dag()
        while self.evaluate(plan)[0] > limit * (1 + 1e-12):
            for u, v in dag.edges:
                dag.edges[u, v]["weight"] = (self.option(*key_of[u], plan[key_of[u]])[0]
                                             if u in key_of else 0.0)
            raised = False
            for node in nx.dag_longest_path(dag, weight="weight"):
                if node in key_of:
                    key = key_of[node]
                    top = max(self.clocks(*key))
                    raised |= plan[key] != top
                    plan[key] = top
            if not raised:  # the critical path is at max clocks already
                break
        return plan

    @staticmethod
    def time_limit(baseline_time: float, target_time: float | None = None,
                   max_slowdown: float | None = None) -> float:
        """The iteration time a plan may take: `target_time`, ``baseline_time * (1 +
        max_slowdown)``, or the all-max `baseline_time` itself."""
        if target_time is not None and max_slowdown is not None:
            raise ValueError("give either target_time or max_slowdown, not both")
        return (target_time if target_time is not None else
                baseline_time * (1 + (max_slowdown or 0.0)))

    @staticmethod
    def choose(points: list[FrontierPoint], baseline_time: float,
               target_time: float | None = None,
               max_slowdown: float | None = None) -> FrontierPoint:
        """The minimum-energy point within the time allowed: the all-max iteration time
        (default), `target_time` seconds (a straggler elsewhere sets the pace), or
        ``baseline_time * (1 + max_slowdown)``."""
        limit = ClockFrontier.time_limit(baseline_time, target_time, max_slowdown)
        allowed = [p for p in points if p.time_s <= limit * (1 + 1e-9)]
        if not allowed:
            raise ValueError(f"no plan finishes an iteration within {limit:.4f}s; the fastest "
                             f"takes {points[0].time_s:.4f}s")
        return min(allowed, key=lambda p: (p.energy_j, p.time_s))

    def schedules(self, plan: ClockPlan) -> list[dict]:
        """One Zeus-style FrequencySchedule per GPU: its pipeline rank's compute instructions in
        program order (`merak.energy.planning.plan_file.expected_instructions`)."""
        result = []
        for profile in self.profiles:
            freqs = [[a.name, plan[(profile.pp_rank, a)]]
                     for a in self.schedule.compute_actions(profile.pp_rank)]
            result += [{"rank": r, "frequencies": freqs} for r in profile.ranks]
        return sorted(result, key=lambda s: s["rank"])
