"""lowtime's Phillips-Dessouky solver, with its pure-Python min-cut where the compiled one is
missing (lowtime 0.3.0 ships wheels for CPython 3.10-3.13 only; the Python path gives the same
frontier, about 3.5x slower)."""

from __future__ import annotations

import contextlib
import sys
import types

import networkx as nx


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


class CriticalDAG:
    """`lowtime.graph_utils.aoa_to_critical_dag` with the same results, faster.

    lowtime recomputes the whole topology (topological sorts, a full graph copy, then edge
    removals) on every solver iteration, which is most of the planner's time on large pipelines
    (8 stages x 32 micro-batches: thousands of iterations). During one solver run the AOA DAG's
    topology is fixed and only operation durations change, so this keeps the topological order
    and adjacency lists of the last DAG it saw, does the earliest / latest time passes over
    plain lists, sets each operation's four times once, and builds the critical DAG from the
    critical edges only.
    """

    def __init__(self):
        self._dag = None

    def _topology(self, aoa_dag: nx.DiGraph, attr_name: str) -> None:
        order = list(nx.topological_sort(aoa_dag))
        self._edges = [(u, v, data) for u, v, data in aoa_dag.edges(data=True)]
        self._ops = {id(data[attr_name]): data[attr_name] for _, _, data in self._edges}
        self._out = {n: [(v, d[attr_name]) for v, d in aoa_dag[n].items()] for n in order}
        self._in = {n: [(u, aoa_dag[u][n][attr_name]) for u in aoa_dag.predecessors(n)]
                    for n in order}
        self._order, self._dag = order, aoa_dag

    def __call__(self, aoa_dag: nx.DiGraph, attr_name: str = "op") -> nx.DiGraph:
        if aoa_dag is not self._dag:
            if not nx.is_directed_acyclic_graph(aoa_dag):
                raise ValueError("The given graph is not a DAG.")
            self._topology(aoa_dag, attr_name)
        big = sys.maxsize
        duration = {key: op.duration for key, op in self._ops.items()}
        es = dict.fromkeys(self._ops, 0)
        ef = dict.fromkeys(self._ops, 0)
        for node in self._order:  # the forward pass, as lowtime orders it
            for succ, cur in self._out[node]:
                finish = ef[id(cur)]
                for _, nxt in self._out[succ]:
                    key = id(nxt)
                    es[key] = max(es[key], finish)
                    ef[key] = es[key] + duration[key]
        ls, lf = dict.fromkeys(self._ops, big), dict.fromkeys(self._ops, big)
        sink = aoa_dag.graph["sink_node"]
        end = max([ef[id(op)] for _, op in self._in[sink]], default=0)
        end = max(end, 0)
        for _, op in self._in[sink]:
            lf[id(op)] = end
            ls[id(op)] = end - duration[id(op)]
        for node in reversed(self._order):  # the backward pass
            for pred, cur in self._in[node]:
                start = ls[id(cur)]
                for _, prev in self._in[pred]:
                    key = id(prev)
                    ls[key] = min(ls[key], start - duration[key])
                    lf[key] = ls[key] + duration[key]
        for key, op in self._ops.items():
            op.earliest_start, op.earliest_finish = es[key], ef[key]
            op.latest_start, op.latest_finish = ls[key], lf[key]
        critical = nx.DiGraph()
        critical.graph.update(aoa_dag.graph)
        critical.add_nodes_from(aoa_dag.nodes(data=True))
        critical.add_edges_from((u, v, dict(data)) for u, v, data in self._edges
                                if ef[id(data[attr_name])] == lf[id(data[attr_name])])
        return critical


@contextlib.contextmanager
def fast_critical_dag():
    """Within the block, lowtime's solver computes critical DAGs with `CriticalDAG`."""
    import lowtime.solver

    original = lowtime.solver.aoa_to_critical_dag
    lowtime.solver.aoa_to_critical_dag = CriticalDAG()
    try:
        yield
    finally:
        lowtime.solver.aoa_to_critical_dag = original
