"""lowtime's Phillips-Dessouky solver, walked faster: the same iterations, states and min cuts.

`FastPhillipsDessouky.run` replaces lowtime's iteration loop (`lowtime.solver.PhillipsDessouky.run`)
while keeping every step of it that decides the result: lowtime's own AOA conversion and cost
models, the same critical DAG (operations whose earliest and latest finish agree), the same flow
bounds, lowtime's min cut, and the same duration changes, so each iteration leaves every
operation at the duration (and clock) lowtime's loop leaves it. What costs lowtime its time:

- the time passes: the topology is fixed during a run, so it is indexed once and the earliest /
  latest passes run over plain lists of the activity-on-node DAG (half the AOA DAG's nodes),
  without setting four attrs fields per operation (lowtime's `aoa_to_critical_dag`);
- no networkx graph per iteration: the critical edges go to the min cut as arrays, with only the
  nodes they touch (a node without critical edges carries no flow);
- the min cut: `merak.energy.planning.min_cut` computes it exactly in integer units with scipy's max
  flow (several times faster than lowtime's floating-point Edmonds-Karp), and asks lowtime's
  compiled one (`_lowtime_rs.PhillipsDessouky.find_min_cut`) wherever lowtime's rounding could break
  a one-unit tie otherwise (a few percent of iterations; every iteration of a cost model with linear
  pieces) — so each cut is lowtime's (``MERAK_ENERGY_CHECK_CUTS=1`` checks every one against
  lowtime's);
- flow bounds are computed once per operation spec and duration, and nothing the planner does
  not read is computed per iteration (lowtime's total cost, the DFS for the critical path's
  length): each iteration yields its number, the cost change and the quantized time.
  Operations' earliest / latest times are not written back; `duration` and `assigned_knob` are.

lowtime sums the cost change of an iteration over its cut's edges in its set's (hash) order,
this in edge order: the sum only decides when the walk ends (a change below 1e-6).

Where lowtime's compiled part is missing (it ships wheels for CPython 3.10-3.13 only) its
pure-Python reference min cut stands in (`phillips_dessouky`: the same frontier, slower).
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

import networkx as nx
import numpy as np

from merak.energy.planning.min_cut import minimal_min_cut


class _PythonMinCut:
    """Stands in for the compiled ``lowtime._lowtime_rs.PhillipsDessouky``: same constructor,
    `find_min_cut` by lowtime's own reference implementation."""

    solver_class = None  # lowtime.solver.PhillipsDessouky, set on install

    def __init__(self, fp_error, nodes, source, sink, edges):
        dag = nx.DiGraph()
        dag.add_nodes_from(nodes)
        for (u, v), (capacity, flow, ub, lb) in edges:
            dag.add_edge(u, v, capacity=capacity, flow=flow, ub=ub, lb=lb)
        dag.graph.update(source_node=source, sink_node=sink)
        self.dag = dag

    def find_min_cut(self):
        # the reference method reads only its argument, not the solver instance
        return self.solver_class.find_min_cut(None, self.dag)


def phillips_dessouky():
    """lowtime's `PhillipsDessouky` class (compiled min-cut, or the Python fallback)."""
    try:
        from lowtime.solver import PhillipsDessouky
        return PhillipsDessouky
    except ImportError as error:
        if "_lowtime_rs" not in str(error):
            raise
    import lowtime

    stub = types.ModuleType("lowtime._lowtime_rs")
    stub.PhillipsDessouky = _PythonMinCut
    sys.modules["lowtime._lowtime_rs"] = stub  # lowtime.solver imports it at module level
    lowtime._lowtime_rs = stub
    from lowtime.solver import PhillipsDessouky

    _PythonMinCut.solver_class = PhillipsDessouky
    return PhillipsDessouky


@dataclass
class Iteration:
    """One iteration of `FastPhillipsDessouky.run` (lowtime's `IterationResult` less its total
    cost, which the planner re-scores exactly itself)."""

    iteration: int
    cost_change: float
    quant_time: int


INF_CAPACITY = 10000.0  # lowtime's `annotate_capacities`


def _rounded(value: float, fp_error: float) -> float:
    return value // fp_error * fp_error


def flow_bounds(op, fp_error: float) -> tuple[float, float]:
    """(lb, ub) of a critical operation at its duration: lowtime's `annotate_capacities`."""
    duration = op.duration
    if op.is_dummy or duration == op.min_duration == op.max_duration:
        lb, ub = 0.0, INF_CAPACITY
    elif duration - 1 < op.min_duration:
        lb, ub = abs(op.get_cost(duration) - op.get_cost(duration + 1)), INF_CAPACITY
    elif duration + 1 > op.max_duration:
        lb, ub = 0.0, abs(op.get_cost(duration - 1) - op.get_cost(duration))
    else:
        lb = abs(op.get_cost(duration) - op.get_cost(duration + 1))
        ub = abs(op.get_cost(duration - 1) - op.get_cost(duration)) + fp_error
    return _rounded(lb, fp_error), _rounded(ub, fp_error)


class _Topology:
    """The AOA DAG as integer-indexed arrays: edge e runs ``head[e] -> tail[e]`` and carries
    ``ops[e]``, in lowtime's edge order. The time passes run over the activity-on-node DAG it
    came from, in topological order: operation i (edge ``op_edge[i]``) finishes at the latest
    finish of its predecessors plus its duration, and the dummy edge ``p -> s`` of the AOA DAG
    is critical when p's earliest finish is s's latest start (what lowtime's passes over the
    AOA DAG give, with half the nodes)."""

    def __init__(self, aon: nx.DiGraph, aoa: nx.DiGraph, attr_name: str):
        order = list(nx.topological_sort(aon))
        index = {node: i for i, node in enumerate(order)}
        self.preds = [[index[p] for p in aon.predecessors(n)] for n in order]
        self.succs = [[index[s] for s in aon.successors(n)] for n in order]
        owner = {id(aon.nodes[n][attr_name]): index[n] for n in order}
        self.head, self.tail, self.ops = [], [], []
        for u, v, data in aoa.edges(data=True):  # lowtime's edge order
            self.head.append(u)
            self.tail.append(v)
            self.ops.append(data[attr_name])
        self.op_edge = np.zeros(len(order), dtype=np.int64)
        left, right = {}, {}  # AOA node -> the operation it starts / ends
        for e, op in enumerate(self.ops):
            i = owner.get(id(op))
            if i is not None:
                self.op_edge[i] = e
                left[self.head[e]], right[self.tail[e]] = i, i
        self.dummy_edge = np.array([e for e, op in enumerate(self.ops) if id(op) not in owner],
                                   dtype=np.int64)
        self.dummy_from = np.array([right[self.head[e]] for e in self.dummy_edge], dtype=np.int64)
        self.dummy_to = np.array([left[self.tail[e]] for e in self.dummy_edge], dtype=np.int64)
        self.op_edges = self.op_edge.tolist()
        self.source, self.sink = aoa.graph["source_node"], aoa.graph["sink_node"]
        self.end_node = index[aon.graph["sink_node"]]

    def critical(self, duration: list[int]) -> tuple[np.ndarray, int]:
        """The critical edges (earliest finish == latest finish) in edge order, and the
        iteration's quantized time: lowtime's `aoa_to_critical_dag`."""
        d = [duration[e] for e in self.op_edges]
        finish = [0] * len(d)
        for i, preds in enumerate(self.preds):  # the source's finish stays 0, as lowtime's
            if preds:
                finish[i] = max([finish[p] for p in preds]) + d[i]
        end = max(finish[self.end_node], 0)
        start = [0] * len(d)  # latest starts
        for i in range(len(d) - 1, -1, -1):
            succs = self.succs[i]
            start[i] = (min([start[s] for s in succs]) if succs else end) - d[i]
        finish, start = np.array(finish), np.array(start)
        critical = np.zeros(len(duration), dtype=bool)
        critical[self.op_edge] = finish == start + np.array(d)
        critical[self.dummy_edge] = finish[self.dummy_from] == start[self.dummy_to]
        return np.flatnonzero(critical), end


def fast_phillips_dessouky():
    """`FastPhillipsDessouky`, a subclass of lowtime's solver (`phillips_dessouky`)."""
    global _FAST
    if _FAST is None:
        _FAST = type("FastPhillipsDessouky", (phillips_dessouky(),), {
            "run": _run, "__doc__": "lowtime's solver with `run` walked faster (see "
                                    "`merak.energy.planning.solver`)."})
    return _FAST


_FAST = None


def _run(self) -> Iterator[Iteration]:
    """lowtime's `PhillipsDessouky.run`, iteration for iteration (see the module docstring)."""
    from lowtime import solver as lowtime_solver
    from lowtime.graph_utils import aon_dag_to_aoa_dag

    fp_error = lowtime_solver.FP_ERROR
    aoa = aon_dag_to_aoa_dag(self.aon_dag, attr_name=self.attr_name)
    dag = _Topology(self.aon_dag, aoa, self.attr_name)
    ops = dag.ops
    for op in ops:  # the slowest plan: where lowtime's walk starts
        if not op.is_dummy:
            op.duration = op.max_duration
    duration = [op.duration for op in ops]
    infinite = _rounded(INF_CAPACITY, fp_error)
    bounds: dict[tuple[int, int], tuple[float, float]] = {}  # (spec, duration) -> (lb, ub)

    def bounds_of(e: int) -> tuple[float, float]:
        op = ops[e]
        if op.is_dummy:
            return 0.0, infinite
        key = (id(op.spec), op.duration)
        if key not in bounds:
            bounds[key] = flow_bounds(op, fp_error)
        return bounds[key]

    lb, ub = (np.array(column) for column in zip(*map(bounds_of, range(len(ops)))))
    head, tail = np.array(dag.head), np.array(dag.tail)
    check = os.environ.get("MERAK_ENERGY_CHECK_CUTS") == "1"
    self.cuts = {"exact": 0, "lowtime": 0}  # which min cut each iteration took
    critical, _ = dag.critical(duration)
    for iteration in range(sys.maxsize):
        edges = critical
        nodes = np.unique(np.concatenate([head[edges], tail[edges], [dag.source, dag.sink]]))
        h, t = np.searchsorted(nodes, head[edges]), np.searchsorted(nodes, tail[edges])
        source, sink = np.searchsorted(nodes, [dag.source, dag.sink])
        cut = minimal_min_cut(len(nodes), source, sink, h, t, lb[edges], ub[edges], fp_error,
                              infinite)
        self.cuts["lowtime" if cut is None else "exact"] += 1
        if cut is None or check:
            lowtime_cut = _lowtime_min_cut(lowtime_solver, fp_error, nodes, dag, edges,
                                           lb, ub)
            if lowtime_cut is None:  # lowtime found no feasible flow: its walk ends
                break
            if check and cut is not None and not np.array_equal(cut, lowtime_cut):
                raise AssertionError(f"iteration {iteration + 1}: the exact min cut differs "
                                     f"from lowtime's")
            cut = lowtime_cut
        speed_up = edges[cut[h] & ~cut[t]].tolist()
        slow_down = edges[~cut[h] & cut[t]].tolist()
        cost_change = _reduce(ops, duration, speed_up, slow_down)
        if cost_change == float("inf") or abs(cost_change) < fp_error:
            break
        for e in speed_up + slow_down:
            lb[e], ub[e] = bounds_of(e)
        critical, quant_time = dag.critical(duration)
        yield Iteration(iteration + 1, cost_change, quant_time)


def _lowtime_min_cut(lowtime_solver, fp_error: float, nodes: np.ndarray, dag: _Topology,
                     edges: np.ndarray, lb: np.ndarray, ub: np.ndarray) -> np.ndarray | None:
    """lowtime's own min cut of the critical `edges` (a mask over `nodes`), or None where it
    finds no feasible flow (lowtime's `LowtimeFlowError`)."""
    from lowtime.exceptions import LowtimeFlowError

    arguments = [((dag.head[e], dag.tail[e]), (0, 0, ub[e], lb[e])) for e in edges.tolist()]
    try:
        runner = lowtime_solver._lowtime_rs.PhillipsDessouky(
            fp_error, nodes.tolist(), dag.source, dag.sink, arguments)
        s_set, _ = runner.find_min_cut()
    except LowtimeFlowError:
        return None
    return np.isin(nodes, list(s_set))


def _reduce(ops, duration: list[int], speed_up: list[int], slow_down: list[int]) -> float:
    """lowtime's `reduce_durations`: speed up the operations of the cut's forward edges and
    slow down those of its backward edges by one unit; returns the cost change (infinite where
    an operation cannot: the walk ends)."""
    if not speed_up:
        return 0.0
    cost_change = 0.0
    for e in speed_up:
        op = ops[e]
        if op.is_dummy or op.duration - 1 < op.min_duration:
            return float("inf")
        cost_change += abs(op.get_cost(op.duration - 1) - op.get_cost(op.duration))
        op.duration -= 1
        duration[e] = op.duration
    for e in slow_down:
        op = ops[e]
        if op.is_dummy:
            continue
        if op.duration + 1 > op.max_duration:
            return float("inf")
        cost_change -= abs(op.get_cost(op.duration) - op.get_cost(op.duration + 1))
        op.duration += 1
        duration[e] = op.duration
    return cost_change
