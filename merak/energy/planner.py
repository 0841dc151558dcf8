"""Plan a GPU clock per pipeline instruction: the iteration-time / energy frontier (Perseus).

The DAG is built from our own schedule generator, the very action lists the interpreter runs, so
the plan's instruction order always matches execution. Each forward / backward is a lowtime
`Operation` whose options are the profiled clocks of its stage. Lowtime's Phillips-Dessouky
solver walks the frontier from the slowest plan to the fastest, one time unit per iteration;
every point is then re-timed exactly with our simulator and scored on total energy:

    energy = sum of instruction energies + p2p_power * sum over GPUs of their idle time

(idle = blocked on p2p). Operation costs are ``energy - p2p_power * gpus * time`` so that the
solver minimizes that total (a GPU computing draws its instruction's energy instead of idling).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import networkx as nx
from lowtime.cost_model import ExponentialModel
from lowtime.graph_utils import add_sink_node, add_source_node
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, Operation, OperationSpec

from merak.energy.profile_data import COMPUTE, StageProfile
from merak.energy.solver import phillips_dessouky
from merak.pipeline.actions import COMPUTE_KINDS, Action, ActionKind, Schedule
from merak.pipeline.simulator import simulate

Plan = dict[tuple[int, Action], int]  # (stage, compute action) -> MHz


@dataclass
class FrontierPoint:
    time_s: float
    energy_j: float
    plan: Plan = field(repr=False)


@dataclass
class PlanCosts:
    """Simulator costs of a plan: each compute action takes its clock's profiled time."""

    times: dict[tuple[int, Action], float]
    p2p: float = 0.0

    def duration(self, stage_id: int, action: Action) -> float:
        return self.times.get((stage_id, action), 0.0)


class EnergyPlanner:
    """Frontier and plan choice for `schedule` over the stage `profiles`.

    Args:
        schedule: the action lists (``make_schedule(name, stages, microbatches)``).
        profiles: one `StageProfile` per stage (`merak.energy.profile_data.aggregate`).
        p2p_power: watts one GPU draws while blocked on communication.
        unit_time: the solver's time quantum in seconds (default: 1 ms, or 1/20 of the
            shortest instruction where that is finer).
    """

    def __init__(self, schedule: Schedule, profiles: list[StageProfile], p2p_power: float,
                 unit_time: float | None = None):
        if len(profiles) != len(schedule):
            raise ValueError(f"the profile has {len(profiles)} stages, the schedule "
                             f"{len(schedule)}; profile the same pipeline you plan for")
        self.schedule, self.profiles, self.p2p_power = schedule, profiles, p2p_power
        self.gpus = [len(p.ranks) for p in profiles]
        shortest = min(min(t for t, _ in opts.values())
                       for p in profiles for opts in p.options.values())
        self.unit_time = unit_time or min(1e-3, shortest / 20)
        self.compute = [(s, a) for s, actions in enumerate(schedule) for a in actions
                        if a.kind in COMPUTE_KINDS]

    # -- exact scoring ------------------------------------------------------------------------
    def option(self, stage: int, action: Action, mhz: int) -> tuple[float, float]:
        return self.profiles[stage].options[action.kind.value][mhz]

    def evaluate(self, plan: Plan) -> tuple[float, float]:
        """(iteration time, total energy) of `plan`, replayed by the simulator."""
        times = {key: self.option(*key, mhz)[0] for key, mhz in plan.items()}
        result = simulate(self.schedule, PlanCosts(times))
        compute = sum(self.option(*key, mhz)[1] for key, mhz in plan.items())
        idle = sum(g * (result.makespan - busy) for g, busy in zip(self.gpus, result.busy))
        return result.makespan, compute + self.p2p_power * idle

    def max_clock_plan(self) -> Plan:
        return {(s, a): max(self.profiles[s].options[a.kind.value]) for s, a in self.compute}

    def physical_limit(self) -> tuple[float, float]:
        """(time, energy) with every instruction at its own most energy-efficient clock,
        ignoring iteration time."""
        plan = {}
        for s, a in self.compute:
            options = self.profiles[s].options[a.kind.value]
            plan[(s, a)] = min(options, key=lambda f, o=options: o[f][1])
        return self.evaluate(plan)

    # -- the frontier -------------------------------------------------------------------------
    def _specs(self) -> dict[tuple[int, str], OperationSpec]:
        specs = {}
        for profile in self.profiles:
            for instruction in COMPUTE:
                gpus = self.gpus[profile.stage]
                options = [ExecutionOption(real_time=t, unit_time=self.unit_time,
                                           cost=e - self.p2p_power * gpus * t, knob=mhz)
                           for mhz, (t, e) in profile.options[instruction].items()]
                candidates = CandidateExecutionOptions(options=options)
                specs[(profile.stage, instruction)] = OperationSpec(
                    options=candidates, cost_model=ExponentialModel(candidates))
        return specs

    def _dag(self) -> tuple[nx.DiGraph, dict[int, tuple[int, Action]]]:
        """The instruction DAG (nodes 1.. are compute actions, 0 and the last are the source
        and sink) and node -> (stage, action); the solver's operations are added by the
        caller."""
        dag, node_of, key_of = nx.DiGraph(), {}, {}
        for node, (stage, action) in enumerate(self.compute, start=1):
            dag.add_node(node)
            node_of[(stage, action)] = node
            key_of[node] = (stage, action)
        for stage, actions in enumerate(self.schedule):  # program order within a stage
            own = [a for a in actions if (stage, a) in node_of]
            for a, b in itertools.pairwise(own):
                dag.add_edge(node_of[(stage, a)], node_of[(stage, b)])
        for (stage, action), node in node_of.items():  # data dependencies between stages
            mb = action.microbatch_id
            if action.kind is ActionKind.FORWARD and stage + 1 < len(self.schedule):
                dag.add_edge(node, node_of[(stage + 1, Action(ActionKind.FORWARD, mb))])
            if action.kind is ActionKind.BACKWARD and stage > 0:
                dag.add_edge(node, node_of[(stage - 1, Action(ActionKind.BACKWARD, mb))])
        source, sink = 0, len(self.compute) + 1
        add_source_node(dag, source)
        add_sink_node(dag, sink)
        dag.graph["source_node"], dag.graph["sink_node"] = source, sink
        return dag, key_of

    def frontier(self) -> list[FrontierPoint]:
        """Every point the solver visits (slowest to fastest) and the all-max-clock plan,
        each scored exactly; sorted by time."""
        dag, key_of = self._dag()
        specs = self._specs()
        for node, (stage, action) in key_of.items():
            dag.nodes[node]["op"] = Operation(spec=specs[(stage, action.kind.value)])
        read = lambda: {key_of[n]: dag.nodes[n]["op"].assigned_knob for n in key_of}
        plans = [read()]
        logging.getLogger("lowtime").setLevel(logging.WARNING)
        for _ in phillips_dessouky()(dag).run():
            plans.append(read())
        plans.append(self.max_clock_plan())
        plans.append(self.fit(plans[-2], self.evaluate(plans[-1])[0]))
        points, seen = [], set()
        for plan in plans:
            signature = tuple(sorted((s, str(a), f) for (s, a), f in plan.items()))
            if signature not in seen:
                seen.add(signature)
                points.append(FrontierPoint(*self.evaluate(plan), plan))
        return sorted(points, key=lambda p: (p.time_s, p.energy_j))

    def fit(self, plan: Plan, limit: float) -> Plan:
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
                    stage, action = key_of[node]
                    top = max(self.profiles[stage].options[action.kind.value])
                    raised |= plan[(stage, action)] != top
                    plan[(stage, action)] = top
            if not raised:  # the critical path is at max clocks already
                break
        return plan

    @staticmethod
    def choose(points: list[FrontierPoint], baseline_time: float,
               target_time: float | None = None,
               max_slowdown: float | None = None) -> FrontierPoint:
        """The minimum-energy point within the time allowed: the all-max iteration time
        (default), `target_time` seconds (a straggler elsewhere sets the pace), or
        ``baseline_time * (1 + max_slowdown)``."""
        if target_time is not None and max_slowdown is not None:
            raise ValueError("give either target_time or max_slowdown, not both")
        limit = (target_time if target_time is not None else
                 baseline_time * (1 + (max_slowdown or 0.0)))
        allowed = [p for p in points if p.time_s <= limit * (1 + 1e-9)]
        if not allowed:
            raise ValueError(f"no plan finishes an iteration within {limit:.4f}s; the fastest "
                             f"takes {points[0].time_s:.4f}s")
        return min(allowed, key=lambda p: (p.energy_j, p.time_s))

    def schedules(self, plan: Plan) -> list[dict]:
        """One Zeus-style FrequencySchedule per rank, in execution order."""
        result = []
        for profile in self.profiles:
            freqs = [[a.kind.value, plan[(profile.stage, a)]]
                     for a in self.schedule[profile.stage] if (profile.stage, a) in plan]
            result += [{"rank": r, "frequencies": freqs} for r in profile.ranks]
        return sorted(result, key=lambda s: s["rank"])
